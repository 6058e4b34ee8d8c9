"""What the client checks of every tensor a peer returns, and how far two honest replicas' outputs may differ.

swarm/client/session.py and sequential.py pass each answer through `checked_output` (and a backward's trainable
gradients through `checked_gradient`); verify.py compares replicas with `disagreement` against `tolerance`. A
failed check is InvalidOutput: the peer is banned and its span rerouted, exactly as if it had failed.
"""

from __future__ import annotations

import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, get_codec
from swarm.codec.base import FLOATING_DTYPES
from swarm.errors import InvalidOutput, InvalidRequest


def checked_output(msg: pb.Tensor, like: torch.Tensor, address: str) -> torch.Tensor:
    """Decode a peer's answer to input `like` [batch, seq, hidden]: blocks map hidden states to hidden states, so
    the answer must have the input's shape, a floating dtype, and only finite values.

    Raises:
        InvalidOutput: naming the check that failed and the peer's address.
    """
    return checked_tensor(decoded_output(msg, address), like, address)


def decoded_output(msg: pb.Tensor, address: str) -> torch.Tensor:
    """A peer's answer decoded; InvalidOutput("decode") for garbage."""
    try:
        return decode(msg)
    except InvalidRequest as error:  # MalformedTensorError, UnknownCodecError: the peer sent garbage
        raise InvalidOutput("decode", f"{address} answered with an undecodable tensor: {error}") from error


def checked_tensor(output: torch.Tensor, like: torch.Tensor, address: str) -> torch.Tensor:
    """`checked_output` for an answer already decoded (a batched answer is decoded once for all its sessions)."""
    if output.shape != like.shape:
        raise InvalidOutput("shape", f"{address} answered {list(output.shape)} to an input of {list(like.shape)}")
    if output.dtype not in FLOATING_DTYPES:
        raise InvalidOutput("dtype", f"{address} answered in {output.dtype}, not a floating dtype")
    if not bool(torch.isfinite(output).all()):
        raise InvalidOutput("finite", f"{address} answered with NaN or Inf values")
    return output


def checked_gradient(msg: pb.Tensor, sent: torch.Tensor | None, what: str, address: str) -> torch.Tensor:
    """Decode a peer's d loss / d `what`, a trainable tensor the client sent it (`sent`; None: it sent none): the
    gradient must have the tensor's shape and only finite values, or it would corrupt the optimizer's step.

    Raises:
        InvalidOutput: naming the check that failed, the tensor and the peer's address.
    """
    if sent is None:
        raise InvalidOutput("shape", f"{address} answered a gradient of {what}, which it was not sent")
    try:
        grad = decode(msg)
    except InvalidRequest as error:
        raise InvalidOutput("decode", f"{address} answered an undecodable gradient of {what}: {error}") from error
    if grad.shape != sent.shape:
        raise InvalidOutput(
            "shape", f"{address} answered a gradient of {what} of shape {list(grad.shape)}, not {list(sent.shape)}"
        )
    if grad.dtype not in FLOATING_DTYPES or not bool(torch.isfinite(grad).all()):
        raise InvalidOutput("finite", f"{address} answered a gradient of {what} with NaN, Inf or no floats")
    return grad


def disagreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance ||a - b|| / max(||a||, ||b||) of two answers to the same input (0 for two zeros)."""
    a, b = a.double(), b.double()
    scale = max(float(a.norm()), float(b.norm()))
    return float((a - b).norm()) / scale if scale > 0 else 0.0


def tolerance(codec: CodecId, margin: float) -> float:
    """How far two honest replicas' answers may be apart when both travel through `codec`.

    Both replicas get the same input (the client encodes the same tensor for each; re-encoding an already
    quantised tensor gives it back), so they compute the same y up to float rounding, and each answer reaches the
    client off by at most the codec's worst-case relative error (Codec.max_error): the triangle inequality gives
    2 x max_error. `margin` covers what the codec does not: float rounding (a replica catching up computes many
    tokens at once where the other computed them one by one) and nothing else: replicas computing in different
    dtypes (bfloat16 against float32) differ by more, and swarms mixing them need a larger margin.
    """
    return 2 * get_codec(codec).max_error(torch.float32) + margin
