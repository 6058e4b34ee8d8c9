"""One inference stream to one peer: a span's KV cache on that peer, steps sent and answers received, and how long
an answer is waited for (late after the hop's pace; longer for a peer that still answers a health probe).

session.py's InferenceSession strings these along a route and fails them over.
"""

from __future__ import annotations

import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import grpc
import torch

from swarm._proto import swarm_pb2 as pb
from swarm._proto import swarm_pb2_grpc as pb_grpc
from swarm.channels import PeerStubs
from swarm.client.checks import checked_output
from swarm.codec import CodecId, encode, join, split
from swarm.errors import DeadlineExceeded, InvalidOutput, InvalidRequest, PeerUnavailable, error_for
from swarm.security import SwarmCredentials
from swarm.types import Hop

MAX_MESSAGE_BYTES = 4 << 20  # what the client sends in one message; bigger tensors go in chunks
MAX_RECEIVE_BYTES = 64 << 20  # accept whatever a peer configured above the default sends
MIN_CHUNK_BYTES = 1024  # a peer chunks answers at its message limit, never this small
PROBE_TIMEOUT_S = 0.4  # a late peer that answers a health probe this fast is busy, not frozen
PUSH_TOKEN_BYTES = 16  # a session's push token: 128 random bits, not guessable within any session's life
_CLOSED = object()


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
    ) -> None:
        """With `stubs` the stream runs on their shared channel to the peer (left open at close); without, on a
        channel of its own. `adapter`: the served LoRA adapter the peer applies to this session ("" for none)."""
        self.hop, self.codec, self.step_timeout_s = hop, codec, step_timeout_s
        self.compress_min_bytes = compress_min_bytes
        self.session_id = uuid.uuid4().hex
        # Handed to the previous hop alone (in `target`); a new one per epoch (`fence`). Issue 35.
        self.push_token = secrets.token_bytes(PUSH_TOKEN_BYTES)
        self.fenced = False  # the peer said it checks push tokens (InferenceResponse.fenced): it takes `fence`
        self._channel: grpc.Channel | None = None
        if stubs is None:
            self._channel = credentials.channel(hop.address, [("grpc.max_receive_message_length", MAX_RECEIVE_BYTES)])
        self._stub = pb_grpc.PeerStub(self._channel) if stubs is None else stubs(hop.address)
        self._requests: queue.Queue[pb.InferenceRequest | None] = queue.Queue()
        self._responses: queue.Queue[object] = queue.Queue()
        opening = pb.InferenceOpen(
            protocol_version=pb.PROTOCOL_VERSION_CURRENT,
            session_id=self.session_id,
            start_block=hop.span.start,
            end_block=hop.span.end,
            batch_size=batch_size,
            max_length=max_length,
            response_codec=pb.CodecChoice(codec=int(codec), compress_min_bytes=compress_min_bytes),
            adapter=adapter,
            push_token=self.push_token,
        )
        self._requests.put(pb.InferenceRequest(open=opening))
        self._call = self._stub.Inference(iter(self._requests.get, None))
        threading.Thread(target=self._read, name=f"session-{hop.address}", daemon=True).start()

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
        self._requests.put(pb.InferenceRequest(fence=pb.InferenceFence(push_token=self.push_token)))

    def _read(self) -> None:
        try:
            for response in self._call:
                self._responses.put(response)
        except grpc.RpcError as error:
            self._responses.put(error)
        self._responses.put(_CLOSED)

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
        for chunk in split(encode(hidden, self.codec, compress_min_bytes=self.compress_min_bytes), MAX_MESSAGE_BYTES):
            step = pb.InferenceStep(
                step_id=step_id, position=position, hidden_states=chunk, push_to=push_to, hypo_ids=hypo_ids
            )
            self._requests.put(pb.InferenceRequest(step=step))

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
            DeadlineExceeded: no answer in time; the stream is cancelled.
            InvalidOutput: the answer is not hidden states of the input's shape (swarm/client/checks.py).
            SwarmError subclasses mapped from the peer's gRPC status (swarm/errors.py).
        """
        timeout_s = self.step_timeout_s if timeout_s is None else timeout_s
        wait = _Wait(timeout_s, timeout_s if patience_s is None else patience_s, self.probe, resend)
        first = self._next_response(wait)
        while first.step_id != step_id:  # a late answer to a step we had already given up on
            first = self._next_response(wait)
        expected = max(first.hidden_states.num_chunks, 1)
        if expected > like.numel() * 4 // MIN_CHUNK_BYTES + 1:  # float32 without compression, chunks of >= 1 KiB
            raise InvalidOutput("decode", f"{self.hop.address} announces {expected} chunks for {list(like.shape)}")
        chunks = [first.hidden_states]
        while len(chunks) < expected:
            chunks.append(self._next_response(wait).hidden_states)
        try:
            whole = join(chunks)
        except InvalidRequest as error:  # chunks that do not fit together: the peer's fault, not ours
            raise InvalidOutput("decode", f"{self.hop.address}: {error}") from error
        return checked_output(whole, like, self.hop.address), first.pushed

    def step(self, hidden: torch.Tensor, position: int, step_id: int) -> torch.Tensor:
        self.send(hidden, position, step_id)
        return self.receive(step_id, hidden)[0]

    def probe(self) -> Callable[[], bool]:
        """Start a health call; the function returned tells (waiting for the call, at most PROBE_TIMEOUT_S) whether
        the peer answered it. A frozen process (SIGSTOP, a paused VM) does not; a busy one does."""
        call = self._stub.Health.future(pb.HealthRequest(), timeout=PROBE_TIMEOUT_S)

        def answered() -> bool:
            try:
                call.result()
            except grpc.RpcError:
                return False
            return True

        return answered

    def _next_response(self, wait: _Wait) -> pb.InferenceResponse:
        while True:
            try:
                item = self._responses.get(timeout=wait.remaining_s())
                break
            except queue.Empty:
                if wait.go_on():
                    continue
                self._call.cancel()
                raise DeadlineExceeded(f"{self.hop.address}: no answer within {wait.waited_s():.2f} s") from None
        if isinstance(item, grpc.RpcError):
            raise error_for(item.code(), f"{self.hop.address}: {item.details()}")
        if item is _CLOSED:
            raise PeerUnavailable(f"{self.hop.address}: the peer closed the session")
        self.fenced = self.fenced or item.fenced  # type: ignore[attr-defined]
        return item  # type: ignore[return-value]

    def close(self) -> None:
        self._requests.put(None)
        self._call.cancel()
        if self._channel is not None:
            self._channel.close()


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
