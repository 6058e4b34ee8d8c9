"""One session on one peer: a span's KV cache on that peer, steps sent and answers received, and how long an
answer is waited for (late after the hop's pace; longer for a peer that still answers a health probe).

The session travels on the Sessions stream its process shares with that peer (peer_link.py: `PeerStubs.link`),
batched with the process's other sessions there; a peer that does not serve that stream (an older one) gets the
session on an `Inference` stream of its own (inference_stream.py). session.py's InferenceSession strings these
along a route and fails them over.
"""

from __future__ import annotations

import queue
import secrets
import time
import uuid
from collections.abc import Callable, Sequence

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.channels import PeerStubs
from swarm.client.checks import checked_tensor
from swarm.client.inference_stream import InferenceStream
from swarm.client.peer_link import LinkSession, PeerLink, SessionsUnsupported
from swarm.codec import CodecId
from swarm.errors import DeadlineExceeded, SwarmError
from swarm.registry.tunnel import channel_address
from swarm.security import SwarmCredentials
from swarm.types import Hop

MAX_RECEIVE_BYTES = 64 << 20  # accept whatever a peer configured above the default sends
PROBE_TIMEOUT_S = 0.4  # a late peer that answers a health probe this fast is busy, not frozen
PUSH_TOKEN_BYTES = 16  # a session's push token: 128 random bits, not guessable within any session's life


class SpanSession:
    """One peer, one span, one KV cache. `send` a step, then `receive` the span's output for it; the output may
    also come from a step the previous peer pushed here."""

    def __init__(
        self,
        hop: Hop,
        batch_size: int,
        max_length: int,
        codec: CodecId,
        step_timeout_s: float,
        credentials: SwarmCredentials,
        compress_min_bytes: int = 0,
        stubs: PeerStubs | None = None,
        adapter: str = "",
        batched: bool = True,
    ) -> None:
        """With `stubs` the session shares their Sessions stream to the peer (left open at close); without, it
        gets a stream, on a channel, of its own. `adapter`: the served LoRA adapter the peer applies to this
        session's rows ("" for none). `batched=False`: on an Inference stream of its own, as clients before the
        Sessions stream talked to peers (what older clients still send)."""
        self.hop, self.codec, self.step_timeout_s = hop, codec, step_timeout_s
        self.compress_min_bytes = compress_min_bytes
        self.session_id = uuid.uuid4().hex
        # Handed to the previous hop alone (in `target`); a new one per epoch (`fence`). Issue 35.
        self.push_token = secrets.token_bytes(PUSH_TOKEN_BYTES)
        self._shape = (batch_size, max_length, adapter)
        self._channel: grpc.Channel | None = None
        if stubs is None:
            address = channel_address(hop.address, credentials)
            self._channel = credentials.channel(address, [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        self._stub = pb_grpc.PeerStub(self._channel) if stubs is None else stubs(hop.address)
        link = None
        if batched:
            link = stubs.link(hop.address) if stubs is not None else PeerLink(self._stub, hop.address)
        self._private_link = link if stubs is None else None
        # Steps sent before the first answer: sent again should the peer turn out not to serve Sessions.
        self._unconfirmed: list[tuple] | None = None
        self._early: list[object] = []  # what came instead of a PrefixHeld (an error): the next receive takes it
        self._transport: LinkSession | InferenceStream
        if link is None:
            self._transport = self._inference_stream()
        else:
            self._transport = link.open(self._opening(), codec, compress_min_bytes)
            self._unconfirmed = []

    def _opening(self) -> pb.InferenceOpen:
        batch_size, max_length, adapter = self._shape
        return pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=self.session_id,
            start_block=self.hop.span.start,
            end_block=self.hop.span.end,
            batch_size=batch_size,
            max_length=max_length,
            response_codec=pb.CodecChoice(codec=int(self.codec), compress_min_bytes=self.compress_min_bytes),
            adapter=adapter,
            push_token=self.push_token,
        )

    def _inference_stream(self) -> InferenceStream:
        return InferenceStream(self._stub, self.hop.address, self._opening(), self.codec, self.compress_min_bytes)

    @property
    def fenced(self) -> bool:
        """The peer checks push tokens and takes `fence` (a peer serving Sessions does; an older one may not)."""
        return self._transport.fenced

    @property
    def target(self) -> pb.PushTarget:
        """Where the previous hop pushes its output, with the token that lets it: give it to that hop only."""
        return pb.PushTarget(address=self.hop.address, session_id=self.session_id, push_token=self.push_token)

    def fence(self) -> None:
        """Start a new push epoch: the peer refuses pushes with the old token from now on, even those it holds
        queued. Called when the previous hop was replaced: its late pushes must not touch this cache. Not sent to
        a peer that has not said it checks tokens (an older one, which would end the stream on it)."""
        if not self.fenced:
            return
        self.push_token = secrets.token_bytes(PUSH_TOKEN_BYTES)
        self._transport.fence(self.push_token)

    def send_prefix(self, message: pb.SessionPrefix) -> bool:
        """Send the session's prefix keys (swarm/prefix_keys.py; the message's session_id is filled in); False where
        the peer takes none (a session on an Inference stream of its own). With `attach`, read the answer with
        `held`."""
        if not isinstance(self._transport, LinkSession):
            return False
        self._transport.prefix(message)
        return True

    def held(self, timeout_s: float) -> int:
        """The tokens the session holds from the peer's prefix cache, once it answered send_prefix(attach=True); 0
        when it does not answer within `timeout_s` (a late answer is skipped) or the session failed (the error is
        kept for the next `receive`)."""
        try:
            item = self._transport.answers.get(timeout=timeout_s)
        except queue.Empty:
            return 0
        if isinstance(item, pb.PrefixHeld):
            return int(item.tokens)
        self._early.append(item)
        return 0

    def send(
        self,
        hidden: torch.Tensor,
        position: int,
        step_id: int,
        push_to: Sequence[pb.PushTarget] = (),
        hypo_ids: Sequence[int] = (),
    ) -> None:
        """Send new tokens' hidden states [batch, new_tokens, hidden] at `position` as step `step_id`; with
        `hypo_ids` (beam search), row i first continues from row hypo_ids[i]'s cache."""
        if self._unconfirmed is not None:
            self._unconfirmed.append((hidden, position, step_id, tuple(push_to), tuple(hypo_ids)))
        self._transport.send(hidden, position, step_id, push_to, hypo_ids)

    def receive(
        self,
        step_id: int,
        like: torch.Tensor,
        timeout_s: float | None = None,
        patience_s: float | None = None,
        resend: Callable[[], None] | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """The output of step `step_id`, whose input was `like`, and whether the peer pushed it on to the next one.

        An answer is late after `timeout_s` (default step_timeout_s). With `patience_s`, a late peer that still
        answers a health probe is busy, not frozen: its answer is awaited until `patience_s` in all. `resend`, for
        a step the previous peer pushed here, sends it again from the client when the answer is late (the push may
        have been lost after that peer answered; a peer runs a step id once, so a push that did arrive costs
        nothing more).

        Raises:
            DeadlineExceeded: no answer in time; the session is closed.
            InvalidOutput: the answer is not hidden states of the input's shape (swarm/client/checks.py).
            SwarmError subclasses mapped from the peer's gRPC status (swarm/errors.py).
        """
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        wait = _Wait(timeout_s, timeout_s if patience_s is None else patience_s, self.probe, resend)
        answered, pushed, output = self._next_answer(wait, like)
        while answered != step_id:  # a late answer to a step we had already given up on
            answered, pushed, output = self._next_answer(wait, like)
        self._unconfirmed = None
        return checked_tensor(output, like, self.hop.address), pushed

    @property
    def batched(self) -> bool:
        """On the process's shared stream, nothing held back for `receive`: the client engine can take its answers."""
        return isinstance(self._transport, LinkSession) and not self._early

    def wake_with(self, waker: Callable[[str], None]) -> None:
        """Call `waker(self.session_id)` from the stream's reader whenever something arrives for this session."""
        if isinstance(self._transport, LinkSession):
            self._transport.wake_with(waker)

    def poll(self, step_id: int, like: torch.Tensor) -> tuple[torch.Tensor, bool] | None:
        """`receive` without waiting: the output of step `step_id` and whether it was pushed on, or None while it
        has not arrived. An error is kept for the next `receive` (the session's own step meets it and fails over).

        Raises:
            SwarmError subclasses, as `receive`.
        """
        while True:
            if self._early:
                item = self._early.pop(0)
            else:
                try:
                    item = self._transport.answers.get_nowait()
                except queue.Empty:
                    return None
            if isinstance(item, pb.PrefixHeld):
                continue
            try:
                answered, pushed, output = self._transport.answer(item, _nothing_more, like)
            except SwarmError:
                self._early.insert(0, item)
                raise
            if answered == step_id:
                self._unconfirmed = None
                return checked_tensor(output, like, self.hop.address), pushed

    def give_up(self, error: SwarmError) -> None:
        """Stop waiting on this peer (the client engine found it late and silent): the session is closed there, and
        the next `receive` raises `error` at once, so that the session's own step fails it over."""
        self._transport.abandon()
        self._early.insert(0, error)

    def step(self, hidden: torch.Tensor, position: int, step_id: int) -> torch.Tensor:
        self.send(hidden, position, step_id)
        return self.receive(step_id, hidden)[0]

    def probe(self) -> Callable[[], bool]:
        """Start a health call; the function returned tells (waiting for the call, at most PROBE_TIMEOUT_S) whether
        the peer answered it, or sent anything on the stream this session shares since the probe began. A frozen
        process (SIGSTOP, a paused VM) does neither; a busy one does one or both (its Health handler may wait on
        a process crowded with session threads, while its engine goes on answering other sessions)."""
        started = time.monotonic()
        call = self._stub.Health.future(pb.HealthRequest(), timeout=PROBE_TIMEOUT_S)
        heard_since = self._transport.heard_since

        def answered() -> bool:
            if heard_since(started):
                return True
            try:
                call.result()
            except grpc.RpcError:
                return heard_since(started)
            return True

        return answered

    def _next_answer(self, wait: _Wait, like: torch.Tensor) -> tuple[int, bool, torch.Tensor]:
        while True:
            item = self._next_item(wait)
            if isinstance(item, pb.PrefixHeld):
                continue  # answered after `held` gave up on it
            try:
                return self._transport.answer(item, lambda: self._next_item(wait), like)
            except SessionsUnsupported:
                if self._unconfirmed is None:
                    raise
                self._fall_back()

    def _fall_back(self) -> None:
        """The peer does not serve Sessions: open the session on an Inference stream of its own and send it again
        what it was sent."""
        sent, self._unconfirmed = self._unconfirmed or [], None
        self._transport = self._inference_stream()
        for args in sent:
            self._transport.send(*args)

    def _next_item(self, wait: _Wait) -> object:
        if self._early:
            return self._early.pop(0)
        while True:
            try:
                return self._transport.answers.get(timeout=wait.remaining_s())
            except queue.Empty:
                if wait.go_on():
                    continue
                self._transport.abandon()
                raise DeadlineExceeded(f"{self.hop.address}: no answer within {wait.waited_s():.2f} s") from None

    def close(self) -> None:
        self._transport.close()
        if self._private_link is not None:
            self._private_link.close()
        if self._channel is not None:
            self._channel.close()


def _nothing_more() -> object:
    raise AssertionError("a shared stream's answers arrive whole")


class _Wait:
    """How long to wait for one answer: until `late_s`; then, if the peer answered a health probe, until
    `patience_s`. The probe starts PROBE_TIMEOUT_S before the late point, so that a frozen peer costs no more than
    `late_s`. Measured from when the wait began, for the whole answer however the peer trickles it."""

    def __init__(
        self,
        late_s: float,
        patience_s: float,
        probe: Callable[[], Callable[[], bool]],
        resend: Callable[[], None] | None = None,
    ) -> None:
        self.resend = resend  # called once, as the probe starts
        self.started = time.monotonic()
        self.at, self.limit, self.probe = self.started + late_s, self.started + max(late_s, patience_s), probe
        self.probe_at = self.at - PROBE_TIMEOUT_S if self.limit > self.at else self.at
        self.answered: Callable[[], bool] | None = None

    def remaining_s(self) -> float:
        until = self.probe_at if self.answered is None and self.limit > self.at else self.at
        return max(until - time.monotonic(), 0.0)

    def waited_s(self) -> float:
        return time.monotonic() - self.started

    def go_on(self) -> bool:
        """Called when a wait ran out: True to wait on (the probe started, or the peer answered it: wait until the
        limit, once); False when the answer is late."""
        if self.limit <= self.at:
            return False
        if self.answered is None:
            if self.resend is not None:
                self.resend()
            self.answered = self.probe()
            if time.monotonic() < self.at:
                return True
        if not self.answered():
            return False
        self.at = self.limit
        return True
