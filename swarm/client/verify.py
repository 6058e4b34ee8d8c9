"""verify_fraction: a fraction of inference steps also runs on a second replica of each hop's span; a peer whose
output disagrees with the others beyond the codec's tolerance is banned.

InferenceSession (session.py) asks `wants()` once per step and, for a step to verify, calls `check` with each
hop's answer. The second replica (the shadow) is a session of its own on another peer serving the whole span,
fed lazily: on a verified step it gets the inputs it has missed plus the step, so it costs one catch-up step per
verified step. Two answers that disagree cannot say which is wrong, so a third replica (the referee) replays the
span's history and the majority decides. With no third replica the client cannot tell: it bans both and reroutes
(their bans expire, so a span served by those two alone goes on after the backoff, re-verified); it never uses an
answer it could not confirm.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from swarm.client.checks import disagreement
from swarm.client.metrics import ClientMetrics
from swarm.errors import InvalidOutput, InvalidRequest, MissingBlocks, SwarmError
from swarm.router import Router
from swarm.types import Hop, PeerInfo

logger = logging.getLogger(__name__)


class StepStream(Protocol):
    """One inference stream on one peer (session.SpanSession)."""

    def step(self, hidden: torch.Tensor, position: int, step_id: int) -> torch.Tensor: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class VerifyPolicy:
    fraction: float  # of steps verified, drawn at random per step; 1.0: every step
    tolerance: float  # relative L2 distance two honest answers stay within (checks.tolerance)
    piece_tokens: int = 1024  # batch x tokens per catch-up step, as replays send them

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"verify_fraction must be in [0, 1], got {self.fraction}")


class _Replica:
    """Another peer's session on the same span, and how many tokens (per sequence) it has been fed."""

    def __init__(self, hop: Hop, stream: StepStream) -> None:
        self.hop, self.stream = hop, stream
        self.fed = 0
        self._step_id = 0

    def run(self, history: torch.Tensor | None, hidden: torch.Tensor, piece_tokens: int) -> torch.Tensor:
        """Feed what it has not seen of `history` [batch, position, hidden], then `hidden` [batch, new, hidden];
        returns its answer for `hidden`'s tokens."""
        if history is not None:  # shorter than what was fed: the session rolled back (rejected drafts)
            self.fed = min(self.fed, history.shape[1])
        missed = history[:, self.fed :] if history is not None else hidden[:, :0]
        feed = torch.cat([missed, hidden], dim=1)
        piece = max(1, piece_tokens // feed.shape[0])
        outputs = []
        for start in range(0, feed.shape[1], piece):
            self._step_id += 1
            outputs.append(self.stream.step(feed[:, start : start + piece], self.fed + start, self._step_id))
        self.fed += feed.shape[1]
        return torch.cat(outputs, dim=1)[:, -hidden.shape[1] :]


class Verifier:
    """Shadows per hop, opened on first use and kept while the hop lives."""

    def __init__(
        self,
        router: Router,
        peers: Callable[[bool], Sequence[PeerInfo]],
        open_stream: Callable[[Hop], StepStream],
        tokens: int,
        policy: VerifyPolicy,
        metrics: ClientMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.router, self.peers, self.open_stream, self.tokens = router, peers, open_stream, tokens
        self.policy, self.metrics, self.rng = policy, metrics, rng or random.Random()
        self._shadows: dict[Hop, _Replica] = {}
        self.worst_agreement = 0.0  # the largest disagreement seen between answers accepted as agreeing

    def wants(self) -> bool:
        """Whether to verify the coming step (drawn once per step, for every hop of it)."""
        return self.rng.random() < self.policy.fraction

    def check(self, hop: Hop, history: torch.Tensor | None, hidden: torch.Tensor, output: torch.Tensor) -> None:
        """Compare `output`, hop's answer to `hidden`, with a second replica's answer. Replicas found wrong are
        banned here; a step no other peer can run goes unverified.

        Raises:
            InvalidOutput: hop's own peer is judged wrong (the session fails it over, which bans it).
        """
        shadow = self._shadows.get(hop) or self._open(hop, exclude={hop.peer_id})
        if shadow is None:
            logger.debug("span=%s: no other replica serves it; step not verified", hop.span)
            return
        self._shadows[hop] = shadow
        second = self._run(shadow, history, hidden)
        if second is None:
            self._shadows.pop(hop, None)
            return
        self.metrics.verified_steps.inc()
        gap = disagreement(output, second)
        if gap > self.policy.tolerance:
            self._settle(hop, shadow, history, hidden, output, second, gap)
        else:
            self.worst_agreement = max(self.worst_agreement, gap)

    def _settle(
        self,
        hop: Hop,
        shadow: _Replica,
        history: torch.Tensor | None,
        hidden: torch.Tensor,
        output: torch.Tensor,
        second: torch.Tensor,
        gap: float,
    ) -> None:
        """The hop and its shadow disagree: ask a referee; ban whoever the majority contradicts."""
        tolerance, both = self.policy.tolerance, f"{hop.peer_id} and {shadow.hop.peer_id}"
        referee = self._open(hop, exclude={hop.peer_id, shadow.hop.peer_id})
        third = self._run(referee, history, hidden) if referee is not None else None
        if third is None:
            self._condemn(hop, shadow)
            raise InvalidOutput(
                "disagreement",
                f"{both} disagree by {gap:.3g} (tolerance {tolerance:.3g}) on blocks {hop.span}, and no third "
                "replica can tell which is wrong: both are banned",
            )
        assert referee is not None
        hop_agrees = disagreement(output, third) <= tolerance
        shadow_agrees = disagreement(second, third) <= tolerance
        if hop_agrees:
            if shadow_agrees:  # within tolerance of both: the two sit at opposite ends of it
                self._close(referee)
            else:
                self._condemn(hop, shadow)
                self._shadows[hop] = referee  # caught up already: it shadows the hop from now on
            return
        if shadow_agrees:
            self._close(referee)
            self.forget(hop)
        else:  # at most one of the three is right, and no one can say which
            self._condemn(hop, referee)
            self._condemn(hop, shadow)
        raise InvalidOutput(
            "disagreement",
            f"{hop.peer_id} disagrees with {shadow.hop.peer_id} by {gap:.3g} (tolerance {tolerance:.3g}) on blocks "
            f"{hop.span}; referee {referee.hop.peer_id} sides with "
            + (shadow.hop.peer_id if shadow_agrees else "neither (all three are banned)"),
        )

    def _open(self, hop: Hop, exclude: set[str]) -> _Replica | None:
        """A session on another peer that serves all of hop's span, or None if there is none."""
        covering = [
            p
            for p in self.peers(False)
            if p.peer_id not in exclude and p.span.start <= hop.span.start and hop.span.end <= p.span.end
        ]
        try:
            route = self.router.choose(hop.span, covering, tokens=self.tokens)
        except MissingBlocks:
            return None
        self.router.acquire(route, self.tokens)
        return _Replica(route[0], self.open_stream(route[0]))  # one hop: every candidate covers the whole span

    def _run(self, replica: _Replica, history: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor | None:
        """The replica's answer; None if it failed (then it is closed and banned like any failed peer)."""
        try:
            return replica.run(history, hidden, self.policy.piece_tokens)
        except InvalidRequest:
            raise  # a bug or a limit: the session's own hop would have refused the same
        except SwarmError as error:
            if isinstance(error, InvalidOutput):
                self.metrics.bad_outputs[error.check].inc()
            self.router.bans.penalize(replica.hop.peer_id, error)
            logger.warning("verifying replica peer=%s failed (%s); not verified", replica.hop.peer_id, error)
            self._close(replica)
            return None

    def _condemn(self, hop: Hop, replica: _Replica) -> None:
        """Ban a replica found wrong and close it."""
        self.metrics.bad_outputs["disagreement"].inc()
        duration = self.router.bans.ban(replica.hop.peer_id)
        peer_id = replica.hop.peer_id
        logger.warning("peer=%s span=%s outvoted by other replicas; banned for %.1f s", peer_id, hop.span, duration)
        if self._shadows.get(hop) is replica:
            del self._shadows[hop]
        self._close(replica)

    def _close(self, replica: _Replica) -> None:
        replica.stream.close()
        self.router.release((replica.hop,), self.tokens)

    def forget(self, hop: Hop) -> None:
        """The session replaced `hop`: its shadow goes too."""
        shadow = self._shadows.pop(hop, None)
        if shadow is not None:
            self._close(shadow)

    def close(self) -> None:
        for hop in list(self._shadows):
            self.forget(hop)
