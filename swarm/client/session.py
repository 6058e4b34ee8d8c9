"""Inference sessions over the swarm: one SpanSession per hop (span_session.py, on the Sessions stream the process
shares with that peer), each holding that span's KV cache.

An InferenceSession keeps, per hop, every input it sent. When a peer dies, drains, hangs past the step deadline
or answers with an error, only that hop's span is rerouted: the replacement peers get the inputs replayed so
they rebuild the KV cache, and the step goes on. Greedy generation then yields the same tokens.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.channels import PeerStubs
from swarm.client.checks import tolerance
from swarm.client.client_engine import ClientEngine
from swarm.client.hop_state import HopState, ReplayFailed, Resume, trimmed
from swarm.client.metrics import ClientMetrics
from swarm.client.pace import LATE_FLOOR_S, HopPace
from swarm.client.prefix_reuse import PromptPrefix, attach_route, register_route
from swarm.client.span_session import SpanSession
from swarm.client.verify import Verifier, VerifyPolicy
from swarm.codec import CodecId
from swarm.errors import (
    InvalidArgument,
    InvalidOutput,
    InvalidRequest,
    MissingBlocks,
    Overloaded,
    PeerUnavailable,
    SwarmError,
)
from swarm.prefix_keys import Tail
from swarm.router import Router, serving
from swarm.router.bans import answered_alive
from swarm.security import SwarmCredentials
from swarm.types import Hop, PeerInfo, Route, Span

logger = logging.getLogger(__name__)

REPLAY_TOKENS = 1024  # batch x tokens per replay step: well under a peer's default max_request_tokens (8192)


class InferenceSession:
    """A session across the whole model (or `need`), with failover. Callers pass only the new tokens.

    `peers(fresh)` lists the swarm's peers; fresh=True asks for a registry read rather than the cached view, which
    the session does after a failure (a restarted peer has a new address).
    """

    def __init__(
        self,
        router: Router,
        peers: Callable[[bool], Sequence[PeerInfo]],
        need: Span,
        batch_size: int,
        max_length: int,
        codec: CodecId,
        step_timeout_s: float = 30.0,
        max_failovers: int = 8,
        push: bool = True,
        metrics: ClientMetrics | None = None,
        *,
        credentials: SwarmCredentials,
        wait_s: float | None = None,
        compress_min_bytes: int = 0,
        stubs: PeerStubs | None = None,
        adapter: str = "",
        late_floor_s: float = LATE_FLOOR_S,
    ) -> None:
        """`stubs`: channels shared with the caller's other sessions and RTT pings (a channel per stream without).
        `adapter`: a LoRA adapter served by name; routes (failovers and verification too) use only peers whose
        records list it, and each peer applies it to this session's rows. `late_floor_s`: no decode step is late
        (swarm/client/pace.py) before this; raise it where peers share a crowded machine with their clients."""
        self.router, self.codec, self.credentials, self.adapter = router, codec, credentials, adapter
        self.peers = (lambda fresh: serving(peers(fresh), adapter)) if adapter else peers
        self.compress_min_bytes, self.stubs = compress_min_bytes, stubs
        self.wait_s = step_timeout_s if wait_s is None else wait_s
        self.metrics = metrics or ClientMetrics("")
        self.batch_size, self.max_length = batch_size, max_length
        self.step_timeout_s, self.max_failovers, self.push = step_timeout_s, max_failovers, push
        self.late_floor_s = late_floor_s
        self.position = self._length = 0  # _length: the hops' cache length, above `position` after a rollback
        self._step_id = 0
        self.failovers = 0  # hops replaced after a failure
        self.waits_for_room = 0  # hops re-routed after an Overloaded peer (alive, full): not failures
        self._full_since: float | None = None  # when the step being run first found a peer full
        self._verifier: Verifier | None = None
        self.engine = ClientEngine.shared(stubs) if stubs is not None else None
        self.hops = self._open(need, inputs=[])

    @property
    def route(self) -> Route:
        return tuple(state.hop for state in self.hops)

    def enable_verification(self, fraction: float, margin: float, rng: random.Random | None = None) -> None:
        """Also run `fraction` of the steps on a second replica of each hop's span and ban peers whose answers
        disagree beyond the codec's tolerance plus `margin` (swarm/client/verify.py). Verified steps go without
        server-to-server push: each answer is checked before the next peer sees it."""
        policy = VerifyPolicy(fraction, tolerance(self.codec, margin), REPLAY_TOKENS)
        self._verifier = Verifier(self.router, self.peers, self._stream, self._tokens, policy, self.metrics, rng)

    def use_prefix(self, prefix: PromptPrefix, embed: Callable[[int], torch.Tensor]) -> int:
        """Before the first step: start from what every hop holds of the prompt in its prefix cache
        (swarm/client/prefix_reuse.py); the number of tokens held, where the first step then goes. `embed(n)`: the
        first hop's inputs for those n tokens, kept as its replay history (the later hops' is missing: a failover
        there replays the whole route from them)."""
        if self.position or self._length or not prefix.keys:
            return 0
        length = attach_route([state.session for state in self.hops], prefix, self.step_timeout_s)
        if length:
            self.hops[0].inputs.append(embed(length))
            for state in self.hops[1:]:
                state.missing = length
            self.position = self._length = length
        return length

    def register_prefix(self, keys: list[bytes], tail: Tail | None) -> None:
        """Give every hop the keys of the session's tokens: the pages it keeps of them when the session ends serve
        this client's next sessions that start the same way."""
        register_route([state.session for state in self.hops], keys, tail)

    def _stream(self, hop: Hop) -> SpanSession:
        return SpanSession(
            hop, self.batch_size, self.max_length, self.codec, self.step_timeout_s, self.credentials,
            self.compress_min_bytes, self.stubs, self.adapter,
        )  # fmt: skip

    def step(self, hidden: torch.Tensor, hypo_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Run new tokens' hidden states [batch, new_tokens, hidden] through every hop; returns the last hop's
        output. A plain step goes with the other sessions' of the process through the client engine (one message
        per peer for the steps that meet there, client_engine.py); a reordering, rolling-back or verified step runs
        alone in the calling thread (step_alone). Either way with failover, and the same output."""
        if self.engine is not None and self.batchable(hypo_ids):
            return self.engine.step(self, hidden)
        return self.step_alone(hidden, hypo_ids)

    def batchable(self, hypo_ids: Sequence[int] | None = None) -> bool:
        """The step can go with the engine's: no reorder, rollback or verification, every hop on a shared stream."""
        plain = not self._checked_hypo_ids(hypo_ids) and self._verifier is None and self.position == self._length
        return plain and all(state.session.batched for state in self.hops)

    def step_alone(
        self, hidden: torch.Tensor, hypo_ids: Sequence[int] | None = None, resume: Resume | None = None
    ) -> torch.Tensor:
        """`step` in the calling thread, with failover: waits on each hop's answer and replaces a failed hop; from
        `resume`'s hop on, for a plain step the client engine gave back (the hops before it answered).

        With push, the client sends the step to the first hop only, and each peer forwards its output to the next;
        the client still reads every hop's output (it is the next hop's replay history) and sends a step itself
        where a push did not happen. With `hypo_ids` (beam search), row i first continues from row hypo_ids[i]:
        every hop reorders its cache, and the replay history is reordered alike.

        Raises:
            InvalidArgument: `hypo_ids` does not name one row of the batch per row.
        """
        hypo = self._checked_hypo_ids(hypo_ids)
        step_id, started = resume.step_id if resume else self.next_step_id(), time.perf_counter()
        verify = self._verifier is not None and self._verifier.wants() and not hypo and not self.hops[-1].missing
        index, must_send, tokens, first = 0, True, hidden.shape[1], hidden
        staged: list[tuple[HopState, torch.Tensor]] = []  # inputs to record once the whole step went through
        if resume is not None:
            index, hidden, staged = resume.index, resume.hidden, list(resume.staged)
        since = time.monotonic()  # when the hop got its input: sent now, or pushed when the previous answer came
        previous_s: float | None = None  # how long the previous hop took for this step
        while index < len(self.hops):
            state = self.hops[index]
            try:
                if must_send:
                    # A reordering or rolling-back step is not pushed: a peer takes those from its client alone
                    # (peers/push.py's PushFence), and a reorder must not be seen twice after a failover.
                    push_to = [] if verify or hypo or self.position < self._length else self.push_targets(index + 1)
                    state.session.send(hidden, self.position, step_id, push_to, hypo)
                waited = time.monotonic() - since
                like_s = None if must_send else previous_s  # a pushed step may have been lost: see HopPace
                late_after = state.pace.deadline_s(tokens, like_s) - waited
                patience = self.step_timeout_s - waited
                resent: list[float] = []  # when the client sent a pushed step itself (the hop's input came then)
                resend = None if must_send else self._resend(state, hidden, step_id, index, resent)
                output, pushed = state.session.receive(
                    step_id, hidden, max(late_after, 0.0), max(patience, 0.0), resend
                )
                previous_s = time.monotonic() - max([since, *resent])
                state.pace.observe(previous_s, tokens)
                if verify:
                    self._verify(state, hidden, output)
            except InvalidRequest:
                raise  # a bug or a limit: no other peer would answer differently
            except SwarmError as error:
                if self._fail_over(index, error):  # the whole route was replaced: the step starts again at hop 0
                    index, hidden, staged = 0, first, []
                # A new id: peers after this hop may have run a step the failed peer pushed them (garbage, if its
                # answer failed the checks); under a new id they run the replacement's at the same position again.
                step_id, must_send, since = self.next_step_id(), True, time.monotonic()
                continue  # the same index now holds the replacement's first hop
            staged.append((state, hidden))
            self.router.bans.forgive(state.hop.peer_id)
            hidden, index, must_send, since = output, index + 1, not pushed, time.monotonic()
        self.record(staged, hypo, hidden.shape[1])
        self.metrics.step_latency.observe(time.perf_counter() - started)
        return hidden

    def record(self, staged: list[tuple[HopState, torch.Tensor]], hypo: tuple[int, ...], tokens: int) -> None:
        """A step went through every hop: keep each hop's input (its replay history) and move on by `tokens`."""
        for state, inputs in staged:
            if hypo:
                state.inputs = [piece[list(hypo)] for piece in state.inputs]
            state.inputs.append(inputs)
        if hypo and self._verifier is not None:  # the shadows' caches follow the old rows: they start over
            for state in self.hops:
                self._verifier.forget(state.hop)
        self.position = self._length = self.position + tokens
        self._full_since = None

    def _checked_hypo_ids(self, hypo_ids: Sequence[int] | None) -> tuple[int, ...]:
        """hypo_ids as sent: () when absent or the identity (nothing moves)."""
        if hypo_ids is None:
            return ()
        hypo = tuple(int(h) for h in hypo_ids)
        if len(hypo) != self.batch_size or not all(0 <= h < self.batch_size for h in hypo):
            raise InvalidArgument("hypo_ids", f"must name one of the {self.batch_size} rows per row, got {list(hypo)}")
        return () if hypo == tuple(range(self.batch_size)) else hypo

    def rollback(self, position: int) -> None:
        """Forget every token from `position` on (rejected speculative drafts). No message is sent: the next step's
        position, below their length, tells the peers to truncate their KV caches; the replay history is trimmed
        the same way, so a replacement peer rebuilds exactly the kept tokens.

        Raises:
            InvalidArgument: `position` is not in [0, self.position].
        """
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= self.position:
            raise InvalidArgument("position", f"must be an int in [0, {self.position}], got {position!r}")
        for state in self.hops:
            state.inputs = trimmed(state.inputs, position - state.missing)
            state.missing = min(state.missing, position)
        self.position = position

    def _verify(self, state: HopState, hidden: torch.Tensor, output: torch.Tensor) -> None:
        assert self._verifier is not None
        history = torch.cat(state.inputs, dim=1) if state.inputs else None
        self._verifier.check(state.hop, history, hidden, output)

    def next_step_id(self) -> int:
        self._step_id += 1
        return self._step_id

    def _resend(
        self, state: HopState, hidden: torch.Tensor, step_id: int, index: int, resent: list[float]
    ) -> Callable[[], None]:
        """Send hop `index` the step it was pushed, should the push have been lost (SpanSession.receive); the time
        goes to `resent`, so that the hop's pace counts from when it really got its input."""

        def resend() -> None:
            state.session.send(hidden, self.position, step_id, self.push_targets(index + 1))
            resent.append(time.monotonic())

        return resend

    def push_targets(self, first: int) -> list[pb.PushTarget]:
        return [state.session.target for state in self.hops[first:]] if self.push else []

    def _fail_over(self, index: int, error: SwarmError) -> bool:
        """Replace hop `index` by a new route for its span, replaying its inputs; retries while peers keep failing.
        True when the whole route was replaced instead: the hop had not got its first inputs (a cached prefix)."""
        failed = self.hops.pop(index)
        failed.session.close()
        if self.stubs is not None and not answered_alive(error):  # the next session there gets a new connection
            self.stubs.forget(failed.hop.address)
        if self._verifier is not None:
            self._verifier.forget(failed.hop)
        self.router.release((failed.hop,), self._tokens)
        culprit, span, inputs, whole = failed.hop.peer_id, failed.hop.span, failed.inputs, bool(failed.missing)
        if whole:  # its first inputs came from prefix caches: the whole route starts again from embeddings
            end = max(state.hop.span.end for state in [failed, *self.hops])
            index, span, inputs = 0, Span(self.hops[0].hop.span.start, end), self.hops[0].inputs
            self._close_hops()
            self.hops = []
        while True:
            if isinstance(error, Overloaded):
                self._count_wait_for_room(error)
            else:
                self._count_failover(error)
            backoff = self.router.bans.penalize(culprit, error)  # a pause or a ban: swarm/router/bans.py decides
            level = logging.INFO if isinstance(error, Overloaded) else logging.WARNING
            logger.log(level, "peer=%s failed (%s); avoided for %.1f s, rerouting", culprit, error, backoff)
            try:
                # The background view first (a DHT read costs a frozen peer's session time); re-read only if it
                # leaves the span uncovered (_choose), e.g. when the failed peer was its only server.
                replacement = self._open(span, inputs, fresh=False)
            except ReplayFailed as replay:
                culprit, error = replay.peer_id, replay.error
                continue
            self.hops[index:index] = replacement
            # Every hop past the failed one starts a new push epoch: the failed peer knew their tokens (push_to
            # carries the rest of the route), and a late push of its would truncate or corrupt their caches.
            for state in self.hops[index + len(replacement) :]:
                state.session.fence()
            return whole

    def _count_failover(self, error: SwarmError) -> None:
        self.failovers += 1
        self.metrics.failovers.inc()
        if isinstance(error, InvalidOutput):
            self.metrics.bad_outputs[error.check].inc()
        if self.failovers > self.max_failovers:
            raise PeerUnavailable(f"gave up after {self.max_failovers} failovers; last: {error}") from error

    def _count_wait_for_room(self, error: Overloaded) -> None:
        """A full peer (its KV pages, its sessions, this client's share of them) is alive: the session steps aside
        and comes back, on another replica or on the same one once it has room, without counting a failover. A
        client with more sessions than the swarm has room for queues them here instead of failing them; only
        `wait_s` of finding no room fails the session."""
        self.waits_for_room += 1
        self.metrics.waits_for_room.inc()
        if self._full_since is None:
            self._full_since = time.monotonic()
        elif time.monotonic() - self._full_since > self.wait_s:
            raise Overloaded(f"no room for the session within {self.wait_s:g} s; last: {error}") from error

    @property
    def _tokens(self) -> int:
        return self.batch_size * self.max_length

    def _open(self, need: Span, inputs: list[torch.Tensor], fresh: bool = False) -> list[HopState]:
        """Open sessions on a new route for `need` and replay `inputs` (what the span had received) through it.

        Raises:
            ReplayFailed: a peer of the new route failed during the replay (everything opened is closed again).
        """
        route = self._choose(need, fresh)
        self.router.acquire(route, self._tokens)
        states = [HopState(hop, self._stream(hop), HopPace(self.step_timeout_s, self.late_floor_s)) for hop in route]
        state = states[0]
        try:
            history = torch.cat(inputs, dim=1) if inputs else None
            for state in states:
                if history is None:
                    break
                state.inputs.append(history)
                history = self._replay(state, history)
        except BaseException as error:
            for opened in states:
                opened.session.close()
            self.router.release(route, self._tokens)
            if isinstance(error, SwarmError) and not isinstance(error, InvalidRequest):
                raise ReplayFailed(state.hop.peer_id, error) from error
            raise
        return states

    def _replay(self, state: HopState, history: torch.Tensor) -> torch.Tensor:
        """Rebuild a fresh hop's KV cache from `history` [batch, tokens, hidden], in pieces a peer accepts."""
        piece = max(1, REPLAY_TOKENS // history.shape[0])
        outputs = [
            state.session.step(history[:, start : start + piece], start, self.next_step_id())
            for start in range(0, history.shape[1], piece)
        ]
        return torch.cat(outputs, dim=1)

    def _choose(self, need: Span, fresh: bool) -> Route:
        """A route for `need`; while some block has no usable peer (all banned, restarting) or only full ones, wait
        for one for up to `wait_s`, re-reading the registry."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return self.router.choose(need, self.peers(fresh), tokens=self._tokens)
            except (MissingBlocks, Overloaded) as error:
                if time.monotonic() >= deadline:
                    if self.adapter and isinstance(error, MissingBlocks):
                        raise MissingBlocks(f"{error} among the peers that serve adapter {self.adapter!r}") from None
                    raise
            time.sleep(0.25)
            fresh = True

    def close(self) -> None:
        self._close_hops()
        if self._verifier is not None:
            self._verifier.close()

    def _close_hops(self) -> None:
        for state in self.hops:
            state.session.close()
        self.router.release(self.route, self._tokens)

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
