"""The trainer side of SWARM training: a job's configuration, its data, the trainers that stream micro-batches
through stage replicas, checkpoints and export.

config.py: TrainConfig (YAML); schedule.py: learning-rate schedule; data.py: tokenized local text;
stage_calls.py: the TrainingStage RPCs as a trainer makes them; trainer.py: Trainer (a Ray actor in a job);
reference.py: the same training in one process (baseline for tests and benchmarks); checkpoints.py: atomic stage
checkpoints; export.py: reassemble a Hugging Face checkpoint;
shared_memory.py: unlink what killed replicas left in /dev/shm; stage_view.py: a trainer's view of the replicas;
inner_optimizer.py: the stage's AdamW step; init_model.py: a random Llama to pre-train from; churn.py: preemption
on a schedule; metrics.py: a trainer's Prometheus metrics.
The stage replicas themselves live in peers/training/, with job.py, which runs a whole job on Ray (`swarm train`).
"""
