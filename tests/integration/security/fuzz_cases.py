"""The fuzz test's inputs, for every Peer RPC, as the bytes sent: random bytes, protobuf-valid messages with random
fields, and mutations of valid requests (bit flips, truncation, wrong shapes, dtypes and codecs, huge and negative
dimensions, NaN and Inf, positions past any context, broken and reordered chunk streams, sessions that skip or
rewind positions), and pushes into a live session by whoever does not hold its push token. Seeded: a failing
case can be replayed."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, encode, split

from .fuzz_oracle import HIDDEN, REQUEST_TYPES

RPCS = tuple(REQUEST_TYPES)
STREAMS = ("ForwardStream", "BackwardStream", "Inference")
V = pb.PROTOCOL_VERSION_CURRENT
U32, U64 = 2**32 - 1, 2**64 - 1
CHUNK_HEADER_BYTES = 1200  # what chunking.split needs beside the data (header allowance, shape, field tags)
# Fuzzer.pushes: what a push into a live session it does not own tries (fuzz_oracle.push_must_refuse says why not)
PUSH_KINDS = ("no token", "unknown token", "past epoch", "rollback", "skip ahead", "hypo_ids", "redirect", "mutated")


@dataclass(frozen=True, slots=True)
class Case:
    family: str  # raw, random or mutated
    rpc: str
    messages: tuple[bytes, ...]


class Fuzzer:
    def __init__(self, seed: int) -> None:
        self.r = random.Random(seed)
        self.g = torch.Generator().manual_seed(seed)

    def cases(self, count: int) -> Iterator[Case]:
        families = (("raw", self.raw), ("random", self.random_fields), ("mutated", self.mutated))
        for _ in range(count):
            family, make = self.r.choices(families, weights=(1, 1, 2))[0]
            rpc = (
                self.r.choice(RPCS)
                if family != "mutated"
                else self.r.choices(RPCS, weights=(3, 3, 2, 2, 4, 1, 0, 0))[0]
            )
            yield Case(family, rpc, tuple(make(rpc)))

    # ---- random bytes ----

    def raw(self, rpc: str) -> list[bytes]:
        count = self.r.randint(0, 3) if rpc in STREAMS else 1
        return [self.blob() for _ in range(count)]

    def blob(self) -> bytes:
        if self.r.random() < 0.002:
            return self.r.randbytes((4 << 20) + self.r.randint(1, 1 << 19))  # over the message limit
        return self.r.randbytes(
            self.r.choice([0, self.r.randint(1, 16), self.r.randint(1, 256), self.r.randint(1, 4096)])
        )

    # ---- protobuf-valid, random fields ----

    def random_fields(self, rpc: str) -> list[bytes]:
        count = self.r.randint(1, 3) if rpc in STREAMS else 1
        return [self.random_request(rpc).SerializeToString() for _ in range(count)]

    def random_request(self, rpc: str):
        r = self.r
        if rpc in ("Info", "Health"):
            return REQUEST_TYPES[rpc]()
        if rpc == "Inference":
            if r.random() < 0.5:
                return pb.InferenceRequest(step=self.random_step())
            opening = pb.InferenceOpen(
                protocol_version=self.enum(),
                session_id=r.choice(["", "s", r.randbytes(8).hex()]),
                start_block=self.block(),
                end_block=self.block(),
                batch_size=r.choice([0, 1, 2, 7, U32]),
                max_length=r.choice([0, 1, 8, 256, 257, U32]),
                response_codec=self.random_choice(),
            )
            return pb.InferenceRequest(open=opening)
        if rpc == "Push":
            return pb.PushRequest(
                protocol_version=self.enum(), session_id=r.randbytes(4).hex(), step=self.random_step()
            )
        fields = dict(
            protocol_version=self.enum(),
            start_block=self.block(),
            end_block=self.block(),
            position=self.position(),
            response_codec=self.random_choice(),
            request_id=r.randbytes(r.randint(0, 8)).hex(),
        )
        if r.random() < 0.9:
            fields["hidden_states"] = self.random_tensor()
        if rpc.startswith("Backward") and r.random() < 0.9:
            fields["grad_outputs"] = self.random_tensor()
        return REQUEST_TYPES[rpc](**fields)

    def random_step(self) -> pb.InferenceStep:
        r = self.r
        return pb.InferenceStep(
            step_id=r.choice([0, 1, U64]), position=self.position(), hidden_states=self.random_tensor()
        )

    def random_tensor(self) -> pb.Tensor:
        r = self.r
        dims = [0, 1, 2, 3, HIDDEN, HIDDEN + 1, 2**20, 2**40, 2**62, -1, -(2**40)]
        return pb.Tensor(
            dtype=self.enum(),
            shape=[r.choice(dims) for _ in range(r.randint(0, 5))],
            codec=r.randint(-2, 9),
            block_size=r.choice([0, 1, 3, 16, 64, 4096, U32]),
            payload=self.blob(),
            scales=r.randbytes(r.randint(0, 64)),
            chunk_index=r.choice([0, 1, 5, U32]),
            num_chunks=r.choice([0, 1, 2, 2**20, U32]),
            outliers=r.choice([0, 1, 8, U32]),
            outlier_indices=r.randbytes(r.randint(0, 32)),
            outlier_values=r.randbytes(r.randint(0, 32)),
            scale_dtype=self.enum(),
        )

    def random_choice(self) -> pb.CodecChoice:
        return pb.CodecChoice(codec=self.r.randint(-1, 9), block_size=self.r.choice([0, 1, 64, 4096, 7, U32]))

    def enum(self) -> int:
        return self.r.choice([0, 1, 1, 2, 3, 6, 7, -1, 2**31 - 1])

    def block(self) -> int:
        return self.r.choice([0, 1, 2, 3, 15, 29, 30, 31, U32])

    def position(self) -> int:
        return self.r.choice([0, 1, 7, 255, 256, 2**31 - 8, 2**31, 2**63, U64])

    # ---- mutations of valid requests ----

    def mutated(self, rpc: str) -> list[bytes]:
        if rpc == "Inference":
            messages = self.valid_session()
        elif rpc in ("ForwardStream", "BackwardStream"):
            messages = self.valid_stream(rpc)
        else:
            messages = [self.valid_request(rpc)]
        for _ in range(self.r.choice([0, 1, 1, 1, 2])):  # some stay valid, to check that valid work succeeds
            self.r.choice(self.MUTATIONS)(self, messages)
        return [m if isinstance(m, bytes) else m.SerializeToString() for m in messages]

    def hidden(self, batch: int, tokens: int) -> torch.Tensor:
        scale = self.r.choice([1.0, 30.0, 1000.0])
        return torch.randn(batch, tokens, HIDDEN, generator=self.g) * scale

    def valid_tensor(self, batch: int, tokens: int) -> pb.Tensor:
        return encode(self.hidden(batch, tokens), self.r.choice(list(CodecId)))

    def header(self) -> dict:
        start = self.r.choice([0, 0, 1])
        end = self.r.choice([e for e in (1, 2) if e > start])
        choice = pb.CodecChoice(codec=self.r.choice([0, *[int(c) for c in CodecId]]))
        return dict(
            protocol_version=V, start_block=start, end_block=end, position=self.r.randint(0, 64), response_codec=choice
        )

    def valid_request(self, rpc: str):
        batch, tokens = self.r.randint(1, 2), self.r.randint(1, 8)
        if rpc == "Push":
            step = pb.InferenceStep(step_id=1, position=0, hidden_states=self.valid_tensor(batch, tokens))
            return pb.PushRequest(protocol_version=V, session_id=self.r.randbytes(8).hex(), step=step)
        if rpc in ("Info", "Health"):
            return REQUEST_TYPES[rpc]()
        request = REQUEST_TYPES[rpc](hidden_states=self.valid_tensor(batch, tokens), **self.header())
        if rpc == "Backward":
            request.grad_outputs.CopyFrom(self.valid_tensor(batch, tokens))
        return request

    def chunks(self, msg: pb.Tensor) -> list[pb.Tensor]:
        pieces = self.r.randint(1, 5)
        return list(split(msg, CHUNK_HEADER_BYTES + msg.ByteSize() // pieces + 1))

    def valid_stream(self, rpc: str) -> list:
        batch, tokens = self.r.randint(1, 2), self.r.randint(1, 12)
        header = self.header()
        hidden = self.chunks(self.valid_tensor(batch, tokens))
        if rpc == "ForwardStream":
            return [pb.ForwardRequest(hidden_states=chunk, **header) for chunk in hidden]
        grads = self.chunks(self.valid_tensor(batch, tokens))
        requests = []
        for index in range(max(len(hidden), len(grads))):
            request = pb.BackwardRequest(**header)
            if index < len(hidden):
                request.hidden_states.CopyFrom(hidden[index])
            if index < len(grads):
                request.grad_outputs.CopyFrom(grads[index])
            requests.append(request)
        return requests

    def valid_session(self) -> list:
        r, header = self.r, self.header()
        batch, max_length = r.randint(1, 2), r.choice([8, 32, 64])
        opening = pb.InferenceOpen(
            protocol_version=V,
            session_id=r.randbytes(8).hex(),
            start_block=header["start_block"],
            end_block=header["end_block"],
            batch_size=batch,
            max_length=max_length,
            response_codec=header["response_codec"],
        )
        messages, position = [pb.InferenceRequest(open=opening)], 0
        for step_id in range(r.randint(0, 4)):
            tokens = r.randint(1, 4)
            if r.random() < 0.2:
                position = r.randint(0, position)  # rewind: the peer rolls its cache back
            if position + tokens > max_length:
                break
            for chunk in self.chunks(self.valid_tensor(batch, tokens)):
                messages.append(
                    pb.InferenceRequest(step=pb.InferenceStep(step_id=step_id, position=position, hidden_states=chunk))
                )
            position += tokens
        return messages

    def pushes(self, session_id: str, past_token: bytes, length: int, batch: int, count: int) -> Iterator[Case]:
        """Pushes into the live session `session_id` (its cache holds `length` tokens, and `past_token` is the token
        of an epoch its client fenced off) by someone who does not hold its current token: each must be refused.
        Family: the kind of push (fuzz_oracle.push_must_refuse)."""
        for _ in range(count):
            kind = self.r.choice(PUSH_KINDS)
            token = {"no token": b"", "unknown token": self.r.randbytes(16)}.get(kind, past_token)
            step = pb.InferenceStep(step_id=self.r.choice([0, 1, 2, U64]), hidden_states=self.valid_tensor(batch, 1))
            step.position = length
            if kind == "rollback":
                step.position = self.r.randrange(length)
            elif kind == "skip ahead":
                step.position = length + self.r.randint(1, 8)
            elif kind == "hypo_ids":
                step.hypo_ids.extend(self.r.randrange(batch) for _ in range(batch))
            elif kind == "redirect":
                step.push_to.add(address=f"10.{self.r.randrange(256)}.0.1:9", session_id="x", push_token=b"y")
            request = pb.PushRequest(protocol_version=V, session_id=session_id, step=step, push_token=token)
            messages: list = [request]
            if kind == "mutated":
                self.r.choice(self.MUTATIONS)(self, messages)
            yield Case(kind, "Push", tuple(m if isinstance(m, bytes) else m.SerializeToString() for m in messages))

    # mutations: each changes `messages` (protobuf objects or bytes) in place

    def _pick(self, messages: list) -> int:
        return self.r.randrange(len(messages))

    def _tensors(self, message) -> list[pb.Tensor]:
        if isinstance(message, bytes):
            return []
        if isinstance(message, pb.InferenceRequest):
            return [message.step.hidden_states] if message.WhichOneof("kind") == "step" else []
        if isinstance(message, pb.PushRequest):
            return [message.step.hidden_states]
        return [
            getattr(message, f)
            for f in ("hidden_states", "grad_outputs")
            if f in message.DESCRIPTOR.fields_by_name and message.HasField(f)
        ]

    def on_tensor(self, messages: list, change: Callable[[pb.Tensor], None]) -> None:
        tensors = [t for m in messages for t in self._tensors(m)]
        if tensors:
            change(self.r.choice(tensors))

    def flip_bits(self, messages: list) -> None:
        index = self._pick(messages)
        data = bytearray(
            messages[index] if isinstance(messages[index], bytes) else messages[index].SerializeToString()
        )
        for _ in range(self.r.randint(1, 8)):
            if data:
                data[self.r.randrange(len(data))] ^= 1 << self.r.randrange(8)
        messages[index] = bytes(data)

    def cut_bytes(self, messages: list) -> None:
        index = self._pick(messages)
        data = messages[index] if isinstance(messages[index], bytes) else messages[index].SerializeToString()
        cut = self.r.randint(0, len(data))
        messages[index] = data[:cut] + (self.r.randbytes(self.r.randint(0, 16)) if self.r.random() < 0.5 else b"")

    def reshape(self, messages: list) -> None:
        def change(t: pb.Tensor) -> None:
            dims = list(t.shape) or [1]
            dims[self.r.randrange(len(dims))] = self.r.choice([0, 1, 3, HIDDEN + 1, 2**31, 2**40, -1, -(2**40)])
            t.shape[:] = dims if self.r.random() < 0.8 else dims[:-1] or [1, 2, 3, 4]

        self.on_tensor(messages, change)

    def retype(self, messages: list) -> None:
        def change(t: pb.Tensor) -> None:
            field = self.r.choice(["dtype", "codec", "block_size", "scale_dtype", "outliers"])
            setattr(t, field, self.r.choice([0, 1, 2, 4, 5, 6, 9, 64, 4096]))

        self.on_tensor(messages, change)

    def resize_bytes(self, messages: list) -> None:
        def change(t: pb.Tensor) -> None:
            field = self.r.choice(["payload", "scales", "outlier_indices", "outlier_values"])
            data = getattr(t, field)
            setattr(
                t,
                field,
                data[: self.r.randint(0, len(data))]
                if self.r.random() < 0.5
                else data + self.r.randbytes(self.r.randint(1, 9)),
            )

        self.on_tensor(messages, change)

    def poison(self, messages: list) -> None:
        def change(t: pb.Tensor) -> None:
            if t.codec != pb.CODEC_NONE or t.dtype != pb.DTYPE_FLOAT32 or len(t.payload) < 4:
                return
            values = bytearray(t.payload)
            offset = 4 * self.r.randrange(len(values) // 4)
            values[offset : offset + 4] = self.r.choice(
                [b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f", b"\xff\xff\x7f\x7f"]
            )
            t.payload = bytes(values)  # NaN, Inf or the largest float32 (finite: the blocks may overflow on it)

        self.on_tensor(messages, change)

    def rechunk(self, messages: list) -> None:
        def change(t: pb.Tensor) -> None:
            setattr(t, self.r.choice(["num_chunks", "chunk_index"]), self.r.choice([0, 1, 2, 3, 7, 2**20, U32]))

        self.on_tensor(messages, change)

    def reorder(self, messages: list) -> None:
        first = 1 if messages and isinstance(messages[0], pb.InferenceRequest) else 0
        if len(messages) - first < 2:
            return
        action, i = self.r.choice(["drop", "repeat", "swap"]), self.r.randrange(first, len(messages))
        if action == "drop":
            del messages[i]
        elif action == "repeat":
            messages.insert(i, messages[i])
        else:
            j = self.r.randrange(first, len(messages))
            messages[i], messages[j] = messages[j], messages[i]

    def reheader(self, messages: list) -> None:
        message = messages[self._pick(messages)]
        if isinstance(message, bytes | pb.InfoRequest | pb.HealthRequest):
            return
        target = (
            message.open
            if isinstance(message, pb.InferenceRequest) and message.WhichOneof("kind") == "open"
            else message
        )
        if isinstance(target, pb.InferenceRequest):
            target.step.position = self.r.choice([0, 1, 3, 9, 64, 2**31, U64])
            target.step.step_id = self.r.choice([0, 1, 2])
            return
        fields = [
            f
            for f in (
                "protocol_version",
                "start_block",
                "end_block",
                "position",
                "batch_size",
                "max_length",
                "session_id",
            )
            if f in target.DESCRIPTOR.fields_by_name
        ]
        field = self.r.choice(fields)
        values = {"protocol_version": [self.enum()], "session_id": [""], "position": [0, 2**31 - 1, 2**31, U64]}
        setattr(target, field, self.r.choice(values.get(field, [0, 1, 2, 3, 30, 31, 257, 2**31, U32])))

    def recodec(self, messages: list) -> None:
        message = messages[self._pick(messages)]
        choice = getattr(message, "response_codec", None) if not isinstance(message, bytes) else None
        if isinstance(message, pb.InferenceRequest) and message.WhichOneof("kind") == "open":
            choice = message.open.response_codec
        if choice is not None:
            choice.codec, choice.block_size = self.r.choice([0, 1, 4, 6, 7, 99]), self.r.choice([0, 0, 3, 64, 4096])

    MUTATIONS = (
        flip_bits,
        cut_bytes,
        reshape,
        retype,
        resize_bytes,
        poison,
        poison,
        rechunk,
        reorder,
        reheader,
        recodec,
    )
