"""StageActor: the Ray actor a training job starts for one stage replica.

It boots a TrainingStagePeer under IdleBoot (boot_priority.py). Imports are most of a boot, so none happen before
__init__: this module imports nothing heavy, and the arguments come pickled (`stage_actor_arguments`), because
unpickling a TrainConfig imports torch through `swarm`; both happen inside IdleBoot instead, on cycles the host's
serving replicas leave. The replica goes back to normal priority once built, before it takes the stage's state (its
siblings hold their next step for that download, see SiblingReplicas), or after `boot_idle_s` at the latest.
"""

from __future__ import annotations

import logging
import pickle
from typing import TYPE_CHECKING, Any

from peers.training.boot_priority import IdleBoot

if TYPE_CHECKING:
    import torch

    from swarm.partition.config import PortableConfig
    from swarm.training.config import TrainConfig

logger = logging.getLogger(__name__)


class StageActor:
    """Plain class; swarm/training/job.py wraps it with ray.remote. Ray runs __init__ again after a crash."""

    def __init__(self, boot_idle_s: float, arguments: bytes) -> None:
        with IdleBoot(boot_idle_s) as boot:
            from peers.training.actor import TrainingStagePeer

            self.peer = TrainingStagePeer(*pickle.loads(arguments), on_built=boot.end)
        self.idle_boot_s = boot.ended_after_s
        logger.info("stage replica %s built, %s s at idle priority", self.peer.peer_id, self.idle_boot_s)

    def info(self) -> dict[str, Any]:
        return self.peer.info() | {"idle_boot_s": self.idle_boot_s}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.peer.parameters()

    def stop(self) -> None:
        self.peer.stop()


def stage_actor_arguments(
    config: TrainConfig,
    start: int,
    end: int,
    initial_peers: list[str],
    peer_id: str,
    model_config: PortableConfig | None = None,  # the model's config as the job read it (open_checkpoint)
) -> tuple[float, bytes]:
    """StageActor's arguments for a TrainingStagePeer(config, start, end, initial_peers, peer_id, model_config)."""
    return config.boot_idle_s, pickle.dumps((config, start, end, initial_peers, peer_id, model_config))
