"""Parameter-efficient fine-tuning through the swarm: the base blocks stay frozen on the peers, the trainable
parameters (a LoRA adapter, or prompt embeddings) and the optimizer stay with the client.

config.py: FinetuneConfig (the JOB.yaml of `swarm finetune`); data.py: JSONL/text datasets cut into padded batches;
trainer.py: FineTuner (one optimizer step per batch, LoRA or prompt tuning); job.py: run_job (a whole job: train, save,
summarise); remote.py: run_on_ray (the same job in a Ray actor on a cluster, through Ray Client).
"""

from __future__ import annotations

from swarm.finetune.config import FinetuneConfig, load_finetune_config
from swarm.finetune.data import Batch, load_examples
from swarm.finetune.trainer import FineTuner

__all__ = ["Batch", "FineTuner", "FinetuneConfig", "load_examples", "load_finetune_config"]
