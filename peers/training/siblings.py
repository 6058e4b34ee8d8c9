"""The other replicas of a stage: who they are (the DHT, re-read every second; the members of an averaging round),
the StepNow broadcast, and their sample counts toward the next step.

Each replica sends its siblings its count after its backwards (Progress, one unary RPC, the latest count only), so
the replica whose backward brings the stage's sum to the target batch knows it and starts the step. Through the
DHT (hivemind's progress records, polled every 0.1-0.5 s) each count went from the replica through hivemind's DHT
process and two p2p daemons to the bootstrap node and back to every sibling: on 2 cores the DHT processes and
daemons took about a third of the CPU of a training run, more than the stage replicas' gRPC and codecs together.

A count comes with the digest of its sender's parameters at that step (peers/training/digest.py): a replica whose
parameters differ from the largest group of its siblings at the same step learns it here between rounds
(`behind_at`), and takes the stage's state (peers/training/replica.py, catch_up).
"""

from __future__ import annotations

import logging
import math
import threading
import time

import grpc

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.channels import PeerStubs
from swarm.registry import Registry
from swarm.training.config import TrainConfig
from swarm.types import PeerState, Span

logger = logging.getLogger(__name__)

STEP_NOW_TIMEOUT_S = 60.0
PROGRESS_TIMEOUT_S = 2.0
REFRESH_PERIOD_S = 1.0


class SiblingReplicas:
    def __init__(
        self, registry: Registry, config: TrainConfig, span: Span, peer_id: str, stop: threading.Event, ttl_s: float
    ) -> None:
        self.registry, self.dht_key, self.span, self.peer_id = registry, config.dht_key, span, peer_id
        self.online: dict[str, str] = {}  # peer id -> address of the ONLINE siblings, as the DHT says
        self.joining = 0  # siblings still taking the stage's state
        self.ttl_s = ttl_s  # of their DHT records
        self._unreachable: dict[str, float] = {}  # address -> when a call to it found nobody there
        self._counts: dict[str, tuple[int, int]] = {}  # peer id -> (step, samples toward it), as it last said
        self._digests: dict[str, tuple[int, bytes]] = {}  # peer id -> (step, digest of its parameters there)
        self._outgoing: tuple[int, int, bytes] | None = None  # this replica's count and digest, not sent yet
        self._wake = threading.Condition()
        self.stubs = PeerStubs(config.credentials, stub_type=pb_grpc.TrainingStageStub)
        self._stop = stop
        self._refresh()
        threading.Thread(target=self._refresh_loop, daemon=True, name="stage-siblings").start()
        threading.Thread(target=self._send_loop, daemon=True, name="stage-progress").start()

    @property
    def addresses(self) -> list[str]:
        """ONLINE siblings, less those a call just found dead: their records outlive them by up to a TTL, and
        counting them would make this replica wait for rounds they cannot join."""
        now = time.monotonic()
        return [a for a in self.online.values() if now - self._unreachable.get(a, -math.inf) > self.ttl_s]

    def live(self) -> dict[str, str]:
        """The siblings this replica averages with: peer id -> address of those `addresses` lists."""
        addresses = set(self.addresses)
        return {peer_id: address for peer_id, address in self.online.items() if address in addresses}

    def unreachable(self, address: str) -> None:
        """A call to `address` found nobody there: leave it out until its record would have expired."""
        self._unreachable[address] = time.monotonic()

    def count(self) -> int:
        """Replicas this one averages with, itself included. A JOINING sibling counts: the stage does not step
        without it (rounds fail and are retried) until it serves or its record expires."""
        return 1 + len(self.addresses) + self.joining

    # ---- sample counts ----

    def heard(self, peer_id: str, step: int, samples: int, digest: bytes = b"") -> None:
        """A sibling's count (its Progress call, from a sibling the service's gate let through: one this replica did
        not know as ONLINE yet, one that has just taken the stage's state, made it re-read the stage's records at
        once, so that a step taken meanwhile counts the newcomer; see introduce)."""
        self._counts[peer_id] = (step, samples)
        if digest:
            self._digests[peer_id] = (step, digest)

    def refresh(self) -> None:
        """Re-read the stage's records now."""
        self._refresh()

    def introduce(self, step: int, digest: bytes = b"") -> None:
        """Tell every sibling that this replica serves (a count of nothing toward `step`), before it takes work;
        returns once each answered or failed, so that their next step already includes it."""
        request = pb.ProgressRequest(peer_id=self.peer_id, step=step, samples=0, params_digest=digest)
        for address in self.addresses:
            self._call(address, "Progress", request, PROGRESS_TIMEOUT_S)

    def digests_at(self, step: int) -> dict[str, bytes]:
        """The live siblings' parameter digests at `step`, as they last said (those at another step say nothing)."""
        known = [(peer_id, self._digests.get(peer_id)) for peer_id in self.live()]
        return {peer_id: entry[1] for peer_id, entry in known if entry is not None and entry[0] == step}

    def samples_toward(self, step: int) -> int:
        """The live siblings' samples toward `step`, as they last said (a sibling at another step adds none)."""
        counts = [self._counts.get(peer_id) for peer_id in self.live()]
        return sum(count[1] for count in counts if count is not None and count[0] == step)

    def tell_progress(self, step: int, samples: int, digest: bytes = b"") -> None:
        """Send this replica's count (and its parameters' digest) to its siblings soon (returns at once; a newer
        count replaces an unsent one)."""
        with self._wake:
            self._outgoing = (step, samples, digest)
            self._wake.notify()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                self._wake.wait_for(lambda: self._outgoing is not None or self._stop.is_set(), timeout=1.0)
                outgoing, self._outgoing = self._outgoing, None
            if outgoing is None:
                continue
            step, samples, digest = outgoing
            request = pb.ProgressRequest(peer_id=self.peer_id, step=step, samples=samples, params_digest=digest)
            for address in self.addresses:
                self._call(address, "Progress", request, PROGRESS_TIMEOUT_S)

    # ---- steps ----

    def start_step(self, step: int) -> None:
        """Tell every sibling to join step `step` now; returns at once (each call waits for its replica's lock)."""
        for address in self.addresses:
            call = (address, "StepNow", pb.StepNowRequest(step=step, peer_id=self.peer_id), STEP_NOW_TIMEOUT_S)
            threading.Thread(target=self._call, args=call, daemon=True).start()

    def _call(self, address: str, method: str, request: object, timeout_s: float) -> None:
        try:
            getattr(self.stubs(address), method)(request, timeout=timeout_s)
        except grpc.RpcError as error:  # dead or restarting: the stage goes on without it
            logger.info("%s to %s failed: %s", method, address, error.code())
            if error.code() is grpc.StatusCode.UNAVAILABLE:
                self.unreachable(address)

    # ---- membership ----

    def _refresh(self) -> None:
        try:
            peers = self.registry.peers(self.dht_key)
        except Exception as error:  # the DHT is shutting down
            logger.debug("cannot read sibling replicas: %s", error)
            return
        siblings = [p for p in peers if p.span == self.span and p.peer_id != self.peer_id]
        self.online = {p.peer_id: p.address for p in siblings if p.state is PeerState.ONLINE}
        self.joining = sum(p.state is PeerState.JOINING for p in siblings)
        # gone, or rejoining with nothing counted (a copy of the keys: Progress calls add counts meanwhile)
        for peer_id in [p for p in list(self._counts) if p not in self.online]:
            self._counts.pop(peer_id, None)
        for peer_id in [p for p in list(self._digests) if p not in self.online]:
            self._digests.pop(peer_id, None)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_PERIOD_S):
            self._refresh()
