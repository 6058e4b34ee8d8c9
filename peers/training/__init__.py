"""Stage replicas for SWARM training: a stage's trainable blocks, its collaborative optimizer and its server.

stage_model.py: StageModel (embeddings for the first stage, blocks, norm + LM head + loss for the last);
optimizer.py: the hivemind collaborative optimizer of a stage (clipped AdamW, schedule, batch rescaling);
replica.py: StageReplica, compute and steps under one lock; service.py: the TrainingStage gRPC servicer;
siblings.py: the stage's other replicas (membership, StepNow, their sample counts); callers.py: who may speak
for a replica (the gate in front of Gradients, Progress and StepNow); gradient_exchange.py: gradient averaging
between replicas over their own servers; digest.py: a cheap fingerprint of a replica's parameters; metrics.py:
Prometheus; actor.py: TrainingStagePeer,
one replica that joins a stage (state from a live replica or a checkpoint); stage_actor.py: StageActor, the Ray
actor a job starts around it; boot_priority.py: IdleBoot, a replica's boot at idle CPU priority; idle_deadline.py:
its deadline, a process of its own; job.py:
TrainingJob, a whole job on Ray (bootstrap node, stage replicas, trainers; `swarm train`).
"""
