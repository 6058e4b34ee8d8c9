"""Where a peer's stage (peers/actor.py StagePeer: its blocks, gRPC server and engine) runs, behind one handle that
PeerDaemon drives: start it, ask what it measures, drain it, kill it, tell whether it is gone for good.

- `RayStage` (the default): a Ray actor. Ray restarts it when it crashes, places it on a cluster (`--ray-address`)
  and pins it to resources (`--ray-resources`); the peer pays for a local Ray node (gcs_server, raylet and its two
  agents) and a second process importing torch.
- `InProcessStage` (`swarm peer join --no-ray`): the stage runs in the command's own process, as a Petals server
  does, so the peer is that process, its DHT process and p2pd. A crash of the stage ends the command (exit 1):
  whatever supervises it (systemd, a container runtime) restarts it, and clients fail over meanwhile.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from peers.config import PeerConfig
from swarm.types import Span

logger = logging.getLogger(__name__)

DrainOutcome = Callable[[float], bool]  # waits up to its argument (seconds); True if all in-flight work finished
INFO_TIMEOUT_S = 5.0  # what a serving stage's info() may take before it counts as not answering


class StageHandle(ABC):
    """One started stage. Every method may be called from any thread."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id

    @abstractmethod
    def info(self, timeout_s: float) -> dict:
        """StagePeer.info(), waiting up to `timeout_s` (for the blocks to load, the first time); raises what the
        start raised, or TimeoutError."""

    @abstractmethod
    def drain(self) -> DrainOutcome:
        """Start draining (refuse new sessions, finish in-flight work within the grace period, stop serving)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop at once, never to be restarted."""

    @abstractmethod
    def allow_push_to(self, addresses: frozenset[str]) -> None:
        """The addresses the stage may push session outputs to (peers/push_targets.py); does not wait."""

    @abstractmethod
    def dead_for_good(self) -> bool:
        """True once it will never serve again (killed, a start that failed, Ray gave up restarting it); False while
        it serves, loads or restarts."""


def start_stage(config: PeerConfig, peer_id: str, span: Span) -> StageHandle:
    """The stage of `span`, loading in the background, where `config.in_process` says."""
    return InProcessStage(config, peer_id, span) if config.in_process else RayStage(config, peer_id, span)


class RayStage(StageHandle):
    def __init__(self, config: PeerConfig, peer_id: str, span: Span) -> None:
        from peers.launch import spawn_peer

        super().__init__(peer_id)
        self.actor: Any = spawn_peer(config, peer_id, span)

    def info(self, timeout_s: float) -> dict:
        import ray

        return ray.get(self.actor.info.remote(), timeout=timeout_s)

    def drain(self) -> DrainOutcome:
        import ray

        drained = self.actor.drain.remote()

        def outcome(timeout_s: float) -> bool:
            try:
                return bool(ray.get(drained, timeout=timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as error:  # dead, restarting or too slow
                logger.warning("peer=%s drain did not complete: %s", self.peer_id, error)
                return False

        return outcome

    def allow_push_to(self, addresses: frozenset[str]) -> None:
        self.actor.allow_push_to.remote(addresses)  # not awaited: the next announce sends the list again anyway

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def dead_for_good(self) -> bool:
        import ray

        try:
            self.info(INFO_TIMEOUT_S)
        except ray.exceptions.ActorDiedError:
            return True
        except Exception:  # busy, or restarting (RayActorError other than died)
            return False
        return False


class InProcessStage(StageHandle):
    """The StagePeer built in this process by a background thread (the caller waits in info(), where a stop signal
    can still interrupt it)."""

    def __init__(self, config: PeerConfig, peer_id: str, span: Span) -> None:
        super().__init__(peer_id)
        self._stage: Future = Future()
        self._killed = threading.Event()
        threading.Thread(target=self._load, args=(config, span), name="stage-load", daemon=True).start()

    def _load(self, config: PeerConfig, span: Span) -> None:
        from peers.actor import StagePeer

        try:
            self._stage.set_result(StagePeer(config, self.peer_id, span))
        except BaseException as error:  # handed to whoever waits in info(): a bad checkpoint, no memory, ...
            self._stage.set_exception(error)

    def info(self, timeout_s: float) -> dict:
        return self._stage.result(timeout=timeout_s).info()

    def drain(self) -> DrainOutcome:
        drained: Future = Future()

        def run() -> None:
            try:
                drained.set_result(self._stage.result().drain() if self._stage.exception() is None else True)
            except BaseException as error:
                drained.set_exception(error)

        threading.Thread(target=run, name="stage-drain", daemon=True).start()

        def outcome(timeout_s: float) -> bool:
            try:
                return bool(drained.result(timeout=timeout_s))
            except Exception as error:
                logger.warning("peer=%s drain did not complete: %s", self.peer_id, error)
                return False

        return outcome

    def allow_push_to(self, addresses: frozenset[str]) -> None:
        if self._stage.done() and self._stage.exception() is None:
            self._stage.result().allow_push_to(addresses)

    def kill(self) -> None:
        """Stop serving now (a drain still running is cut short) and free the port of its /metrics; the blocks go
        with the last reference to the stage."""
        self._killed.set()
        if self._stage.done() and self._stage.exception() is None:
            self._stage.result().stop()

    def dead_for_good(self) -> bool:
        if self._killed.is_set():
            return True
        return self._stage.done() and self._stage.exception() is not None
