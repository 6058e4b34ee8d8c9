"""What a peer must answer to any request, computed from the request's bytes: the oracle of the fuzz test.

It restates the peer's documented rules (docs/architecture.md, "Peer RPCs, errors and metrics") for the fuzzed peer's
configuration (FUZZ in benchmarks/peer_process.py, blocks [0, 2)): `expect(rpc, messages)` says whether the call
must succeed and, if so, with how many answers of which shape. Any other call must fail with an error status.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError

from benchmarks.peer_process import FUZZ
from peers.limits import MESSAGE_OVERHEAD_BYTES, stream_bytes_for
from peers.task_runner import MAX_POSITION, BackwardJob, ForwardJob, TaskRunner
from swarm._proto import swarm_pb2 as pb
from swarm.codec import CODECS, decode, join
from swarm.codec.base import FLOATING_DTYPES
from swarm.errors import InvalidRequest

NUM_BLOCKS, SPAN, HIDDEN = 30, (0, 2), 576
MAX_MESSAGE = FUZZ.max_message_bytes
STREAM_BYTES = stream_bytes_for(FUZZ.max_request_tokens, HIDDEN, MAX_MESSAGE)
INT8_CODECS = {pb.CODEC_INT8_BLOCKWISE_LINEAR, pb.CODEC_INT8_BLOCKWISE_DYNAMIC, pb.CODEC_INT8_HADAMARD}
HUGE = 1e4  # inputs beyond this may overflow in the blocks: then the oracle runs them to see


@dataclass(frozen=True, slots=True)
class Expect:
    ok: bool
    answers: int = 1  # messages of a successful answer (streams)
    shape: list[int] | None = None  # of the answer's tensor, for Forward and Backward (that of the input)
    why: str = ""  # for failure messages of the test


FAIL = Expect(False)
REQUEST_TYPES = {
    "Forward": pb.ForwardRequest,
    "ForwardStream": pb.ForwardRequest,
    "Backward": pb.BackwardRequest,
    "BackwardStream": pb.BackwardRequest,
    "Inference": pb.InferenceRequest,
    "Push": pb.PushRequest,
    "Info": pb.InfoRequest,
    "Health": pb.HealthRequest,
}


class Oracle:
    """`backend` runs the fuzzed span locally, for answers that go out in 8 bits: an 8-bit codec cannot encode
    NaN/Inf, which blocks produce from finite inputs big enough to overflow (the peer then answers INTERNAL)."""

    def __init__(self, backend: TaskRunner) -> None:
        self.backend = backend

    def expect(self, rpc: str, messages: list[bytes]) -> Expect:
        if any(len(data) > MAX_MESSAGE for data in messages):
            return Expect(False, why="over the message limit")
        try:
            requests = [REQUEST_TYPES[rpc].FromString(data) for data in messages]
        except DecodeError:
            return Expect(False, why="does not parse")
        if rpc in ("Info", "Health"):
            return Expect(True)
        if rpc == "Push":
            # Valid or not, these cases never name a live session; push_must_refuse's cases name one
            return Expect(False, why="no such session")
        if rpc == "Inference":
            return self._inference(requests)
        if rpc in ("Forward", "Backward"):
            return self._compute(requests[0], requests[0].hidden_states, self._grads(rpc, requests[0]))
        return self._stream(rpc, requests)

    @staticmethod
    def _grads(rpc: str, request) -> pb.Tensor | None:
        return request.grad_outputs if rpc.startswith("Backward") else None

    def _stream(self, rpc: str, requests: list) -> Expect:
        budget = (2 if rpc == "BackwardStream" else 1) * STREAM_BYTES
        if not requests or sum(r.ByteSize() + MESSAGE_OVERHEAD_BYTES for r in requests) > budget:
            return Expect(False, why="empty or over stream_bytes")
        fields = ("hidden_states", "grad_outputs") if rpc == "BackwardStream" else ("hidden_states",)
        headers = [f.name for f in requests[0].DESCRIPTOR.fields if f.name not in ("hidden_states", "grad_outputs")]
        if any(getattr(r, name) != getattr(requests[0], name) for r in requests[1:] for name in headers):
            return Expect(False, why="chunks disagree on a header field")
        joined = []
        for field in fields:
            chunks = [getattr(r, field) for r in requests if r.HasField(field)]
            try:
                joined.append(join(chunks) if chunks else pb.Tensor())
            except InvalidRequest:
                return Expect(False, why="chunks do not join")
        return self._compute(requests[0], joined[0], joined[1] if len(joined) > 1 else None)

    def _compute(self, request, hidden_msg: pb.Tensor, grads_msg: pb.Tensor | None) -> Expect:
        if request.protocol_version != pb.PROTOCOL_VERSION_CURRENT or not _blocks_ok(request):
            return Expect(False, why="version or blocks")
        hidden = tensor(hidden_msg)
        grads = tensor(grads_msg) if grads_msg is not None else None
        if hidden is None or (grads_msg is not None and (grads is None or grads.shape != hidden.shape)):
            return Expect(False, why="bad tensor")
        if request.position + hidden.shape[1] > MAX_POSITION or not _codec_ok(request.response_codec):
            return Expect(False, why="position or response codec")
        codec = request.response_codec.codec or (hidden_msg if grads_msg is None else grads_msg).codec
        if codec in INT8_CODECS and max(_magnitude(hidden), _magnitude(grads)) > HUGE:
            blocks, position = range(request.start_block, request.end_block), int(request.position)
            if grads is None:
                output = self.backend.forward([ForwardJob(hidden, position, blocks)])[0]
            else:
                output = self.backend.backward(BackwardJob(hidden, grads, position, blocks)).grad_inputs
            if not bool(torch.isfinite(output).all()):
                return Expect(False, why="the blocks overflow: the answer cannot be encoded in 8 bits")
        return Expect(True, shape=list(hidden.shape))

    def _inference(self, requests: list) -> Expect:
        opening = requests[0] if requests else None
        if opening is None or opening.WhichOneof("kind") != "open" or not _open_ok(opening.open):
            return Expect(False, why="bad open")
        session = _Session(opening.open, self.backend)
        for request in requests[1:]:
            if request.WhichOneof("kind") == "fence":
                continue  # a new push token: nothing to answer
            if request.WhichOneof("kind") != "step" or not session.take(request.step):
                return Expect(False, why="bad step")
        return Expect(True, answers=session.answers)


class _Session:
    """What the peer's session does with each step message (peers/service.py, _serve_steps)."""

    def __init__(self, opening: pb.InferenceOpen, backend: TaskRunner) -> None:
        self.batch_size, self.max_length = opening.batch_size, opening.max_length
        self.length, self.answers, self.held = 0, 0, 0
        self.blocks, self.backend = range(opening.start_block, opening.end_block), backend
        self.int8 = opening.response_codec.codec in INT8_CODECS
        self.history: list[tuple[torch.Tensor, int]] = []  # completed steps: (hidden, position)
        self.cache = None  # once an 8-bit session gets a huge input: the session run here too, to see overflows
        self.done: set[tuple[int, int]] = set()  # (step_id, position) of the steps run
        self.chunks: dict[int, list[pb.Tensor]] = {}

    def take(self, step: pb.InferenceStep) -> bool:
        """False when the peer ends the session with an error at this message."""
        if (step.step_id, step.position) in self.done:
            return True
        parts = self.chunks.setdefault(step.step_id, [])
        self.held += step.hidden_states.ByteSize() + MESSAGE_OVERHEAD_BYTES
        if self.held > STREAM_BYTES:
            return False
        parts.append(step.hidden_states)
        if len(parts) < max(step.hidden_states.num_chunks, 1):
            return True
        del self.chunks[step.step_id]
        self.held -= sum(part.ByteSize() + MESSAGE_OVERHEAD_BYTES for part in parts)
        try:
            hidden = tensor(join(parts))
        except InvalidRequest:
            return False
        if hidden is None or hidden.shape[0] != self.batch_size or step.position > self.length:
            return False
        if step.position + hidden.shape[1] > self.max_length:
            return False
        self.history.append((hidden, int(step.position)))
        if self.int8 and (self.cache is not None or _magnitude(hidden) > HUGE) and not self._finite():
            return False
        self.length = step.position + hidden.shape[1]
        self.done.add((step.step_id, int(step.position)))
        self.answers += 1
        return True

    def _finite(self) -> bool:
        """Whether the last step's answer is finite, running the session here (from its start, the first time)."""
        if self.cache is None:
            self.cache = self.backend.span.new_cache(self.batch_size, self.max_length, self.blocks)
            steps = self.history
        else:
            steps = self.history[-1:]
        for hidden, position in steps:
            output = self.backend.span(hidden, position=position, cache=self.cache, blocks=self.blocks)
        return bool(torch.isfinite(output).all())


def tensor(msg: pb.Tensor) -> torch.Tensor | None:
    """The hidden states a peer accepts from `msg`, or None where it refuses them (backend.check)."""
    if not msg.ByteSize():
        return None
    try:
        hidden = decode(msg)
    except InvalidRequest:
        return None
    tokens = hidden.shape[0] * hidden.shape[1] if hidden.dim() == 3 else 0
    if hidden.dim() != 3 or hidden.shape[2] != HIDDEN or hidden.dtype not in FLOATING_DTYPES:
        return None
    if not 0 < tokens <= FUZZ.max_request_tokens or not bool(torch.isfinite(hidden).all()):
        return None
    return hidden


def _magnitude(hidden: torch.Tensor | None) -> float:
    return 0.0 if hidden is None else float(hidden.abs().max())


def _blocks_ok(request) -> bool:
    start, end = request.start_block, request.end_block
    return 0 <= start < end <= NUM_BLOCKS and SPAN[0] <= start and end <= SPAN[1]


def _codec_ok(choice: pb.CodecChoice) -> bool:
    if choice.codec == pb.CODEC_UNSPECIFIED:
        return True
    codec = next((c for c in CODECS.values() if c.codec_id == choice.codec), None)
    return codec is not None and (choice.block_size == 0 or choice.block_size in codec.block_sizes)


def _open_ok(opening: pb.InferenceOpen) -> bool:
    if opening.protocol_version != pb.PROTOCOL_VERSION_CURRENT or not _blocks_ok(opening):
        return False
    if not 1 <= opening.max_length <= FUZZ.max_session_length or opening.batch_size < 1 or opening.adapter:
        return False  # the fuzzed peers serve no named adapter
    if opening.batch_size > FUZZ.max_batch_tokens:
        return False  # one token of every row must fit one engine iteration (issue 35, item 2)
    # The engine admits a session whose every sequence could grow to max_length within the whole pool, in pages.
    pages = opening.batch_size * -(-opening.max_length // FUZZ.page_size)
    fits = pages <= -(-FUZZ.cache_tokens // FUZZ.page_size)
    return _codec_ok(opening.response_codec) and bool(opening.session_id) and fits


def push_must_refuse(kind: str) -> str:
    """Why a push case (Fuzzer.pushes) into a live session it does not own must be refused: none may change it."""
    return {
        "no token": "a push without the session's token",
        "unknown token": "a token the client never gave out",
        "past epoch": "the token of a peer the client fenced off",
        "rollback": "a position below the cache length",
        "skip ahead": "a position past the cache length",
        "hypo_ids": "a reorder",
        "redirect": "a redirect by a fenced-off peer",
        "mutated": "a mangled push without the current token",
    }[kind]
