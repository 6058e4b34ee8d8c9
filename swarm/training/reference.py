"""The same training in one process: the baseline that swarm runs are compared with.

Same checkpoint (loaded by transformers, an implementation independent of ours), same data stream (the first
trainer's seed), same optimizer, clipping and schedule, the same target batch split into the same micro-batches.
Gradients of a step are the mean of its micro-batches' gradients, as a stage's collaborative step averages them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from swarm.training.config import TrainConfig
from swarm.training.data import TokenDataset, load_dataset
from swarm.training.inner_optimizer import RoundBatch, make_inner_optimizer
from swarm.training.schedule import WarmupCosine


@dataclass
class ReferenceRun:
    model: torch.nn.Module
    losses: list[float] = field(default_factory=list)  # one per micro-batch
    samples: int = 0
    seconds: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds else math.nan


def load_reference_model(config: TrainConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32).train()


def train_reference(
    config: TrainConfig, steps: int | None = None, trainer_index: int = 0, samples_per_step: int | None = None
) -> ReferenceRun:
    """Train `steps` optimizer steps (default: the config's) and return the model and its losses.

    `samples_per_step` (default: the target batch) matches a swarm run whose steps averaged more samples than
    the target (replicas learn of each other's samples a little late); the rate is then scaled by the same
    linear rule the stages apply.

    Gradients are clipped per stage of the config, as the stages do.
    """
    model = load_reference_model(config)
    dataset = load_dataset(config.data, config.model)
    generator = torch.Generator().manual_seed(config.seed * 7919 + trainer_index)
    groups = stage_param_groups(model, config.stage_spans(model.config.num_hidden_layers))
    per_step = samples_per_step or config.target_batch
    round_batch = RoundBatch(config.target_batch)
    round_batch.read_samples = lambda: per_step
    optimizer = make_inner_optimizer(groups, config.optimizer, round_batch)
    schedule = WarmupCosine(config.steps, config.optimizer.warmup_fraction, config.optimizer.min_lr_ratio)
    scheduler = LambdaLR(optimizer, schedule)
    micro_batches = max(1, round(per_step / config.micro_batch))
    run = ReferenceRun(model)
    started = time.perf_counter()
    for _ in range(config.steps if steps is None else steps):
        for _ in range(micro_batches):
            input_ids, labels = dataset.sample(config.micro_batch, generator)
            loss = causal_lm_loss(model, input_ids, labels)
            (loss / micro_batches).backward()
            run.losses.append(loss.item())
            run.samples += input_ids.shape[0]
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    run.seconds = time.perf_counter() - started
    return run


def stage_param_groups(model: torch.nn.Module, spans: list[tuple[int, int]]) -> list[dict]:
    """The transformers model's parameters grouped by the stage that holds them in the swarm."""
    groups: list[list[torch.nn.Parameter]] = [[] for _ in spans]
    for name, param in model.named_parameters():
        if name.startswith("model.layers."):
            block = int(name.split(".")[2])
            index = next(i for i, (start, end) in enumerate(spans) if start <= block < end)
        else:
            index = 0 if name.startswith("model.embed_tokens") else len(spans) - 1
        groups[index].append(param)
    return [{"params": params} for params in groups]


def causal_lm_loss(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=input_ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@torch.no_grad()
def evaluate_reference(model: torch.nn.Module, dataset: TokenDataset) -> float:
    input_ids, labels = dataset.eval_batch()
    return causal_lm_loss(model, input_ids, labels).item()
