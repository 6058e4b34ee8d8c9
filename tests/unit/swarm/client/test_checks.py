"""The client's checks of what a peer returns (swarm/client/checks.py) and the verification tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.client.checks import checked_output, disagreement, tolerance
from swarm.codec import CodecId, decode, encode
from swarm.errors import InvalidOutput

LIKE = torch.zeros(2, 3, 8)


def test_a_good_answer_is_decoded() -> None:
    answer = torch.randn(2, 3, 8)
    assert torch.equal(checked_output(encode(answer, CodecId.NONE), LIKE, "peer:1"), answer)
    half = checked_output(encode(answer.half(), CodecId.NONE), LIKE, "peer:1")  # a float16 peer is fine
    assert half.dtype == torch.float16


def garbled():
    msg = encode(torch.randn(2, 3, 8), CodecId.NONE)
    msg.payload = msg.payload[:-4]
    return msg


def unknown_codec():
    msg = encode(torch.randn(2, 3, 8), CodecId.NONE)
    msg.codec = 99
    return msg


@pytest.mark.parametrize(
    ("answer", "check"),
    [
        (garbled, "decode"),
        (unknown_codec, "decode"),
        (lambda: encode(torch.randn(2, 4, 8), CodecId.NONE), "shape"),
        (lambda: encode(torch.randn(3, 8), CodecId.NONE), "shape"),
        (lambda: encode(torch.ones(2, 3, 8, dtype=torch.int64), CodecId.NONE), "dtype"),
        (lambda: encode(torch.full((2, 3, 8), math.nan), CodecId.NONE), "finite"),
        (lambda: encode(torch.full((2, 3, 8), math.inf), CodecId.FLOAT16), "finite"),
    ],
)
def test_garbage_fails_its_check_naming_the_peer(answer, check: str) -> None:
    with pytest.raises(InvalidOutput, match="peer:1") as caught:
        checked_output(answer(), LIKE, "peer:1")
    assert caught.value.check == check


def test_disagreement_is_relative_and_symmetric() -> None:
    a = torch.randn(4, 100)
    assert disagreement(a, a) == 0.0
    assert disagreement(torch.zeros(3), torch.zeros(3)) == 0.0
    assert disagreement(a, 2 * a) == pytest.approx(0.5)
    assert disagreement(2 * a, a) == pytest.approx(0.5)


@pytest.mark.parametrize("codec", list(CodecId))
def test_two_answers_through_the_codec_stay_within_its_tolerance(codec: CodecId) -> None:
    """Hidden states with an outlier channel, as real ones have; two replicas computing the same y up to float
    rounding, each answer sent through the codec."""
    generator = torch.Generator().manual_seed(0)
    y = torch.randn(2, 16, 576, generator=generator)
    y[..., 7] *= 300
    y2 = y + 1e-6 * torch.randn(y.shape, generator=generator) * y.abs()
    gap = disagreement(decode(encode(y, codec)), decode(encode(y2, codec)))
    assert gap <= tolerance(codec, margin=0.0) + 1e-5
    assert tolerance(codec, margin=0.01) == pytest.approx(tolerance(codec, margin=0.0) + 0.01)
