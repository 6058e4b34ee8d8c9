from __future__ import annotations

import pytest
import torch

from swarm._proto import swarm_pb2 as pb
from swarm.codec import CodecId, decode, encode, get_codec
from swarm.codec.int8_hadamard import OUTLIERS_PER_ROW, hadamard
from swarm.errors import MalformedTensorError


def rel_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


@pytest.mark.parametrize("size", [16, 64, 256])
def test_hadamard_is_orthonormal_and_its_own_inverse(size: int) -> None:
    matrix = hadamard(size, torch.device("cpu"))
    assert torch.allclose(matrix @ matrix, torch.eye(size), atol=1e-6)
    assert torch.equal(matrix, matrix.t())


def test_outliers_travel_exactly() -> None:
    tensor = torch.randn(8, 576)
    tensor[:, 100] = 5000.0
    tensor[:, 7] = -300.0
    msg = encode(tensor, CodecId.INT8_HADAMARD)
    assert msg.outliers == OUTLIERS_PER_ROW
    decoded = decode(msg)
    assert torch.equal(decoded[:, 100], tensor[:, 100])
    assert torch.equal(decoded[:, 7], tensor[:, 7])
    assert rel_l2(decoded[:, 8:100], tensor[:, 8:100]) < 0.01


def test_outlier_channels_cost_far_less_error_than_plain_linear() -> None:
    generator = torch.Generator().manual_seed(0)
    tensor = torch.randn(512, 576, generator=generator)
    tensor[:, torch.randperm(576, generator=generator)[:6]] *= 60
    hadamard_error = rel_l2(decode(encode(tensor, CodecId.INT8_HADAMARD, 64)), tensor)
    linear_error = rel_l2(decode(encode(tensor, CodecId.INT8_BLOCKWISE_LINEAR, 64)), tensor)
    assert hadamard_error < 0.005 < linear_error
    assert hadamard_error <= get_codec(CodecId.INT8_HADAMARD).max_error(torch.float32)


def test_wire_size_is_under_27_percent_of_float32_for_hidden_states() -> None:
    tensor = torch.randn(1, 128, 576)
    msg = encode(tensor, CodecId.INT8_HADAMARD)
    assert msg.scale_dtype == pb.DTYPE_FLOAT16
    assert msg.ByteSize() / (tensor.numel() * 4) <= 0.27


@pytest.mark.parametrize("scale", [1e-9, 1e6])
def test_values_outside_the_float16_range_keep_float32_scales(scale: float) -> None:
    tensor = torch.randn(16, 256) * scale
    msg = encode(tensor, CodecId.INT8_HADAMARD)
    assert msg.scale_dtype == pb.DTYPE_FLOAT32
    assert rel_l2(decode(msg), tensor) < 0.01


@pytest.mark.parametrize("shape", [(1,), (3,), (5, 1001), (2, 3, 17), (1, 1, 576), (0, 576), ()])
def test_odd_shapes_round_trip(shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape)
    decoded = decode(encode(tensor, CodecId.INT8_HADAMARD))
    assert decoded.shape == tensor.shape
    if tensor.numel():
        assert rel_l2(decoded, tensor) < 0.01


def test_rows_too_long_for_uint16_indices_skip_outliers() -> None:
    tensor = torch.randn(1, 70_000)
    msg = encode(tensor, CodecId.INT8_HADAMARD)
    assert msg.outliers == 0 and not msg.outlier_indices
    assert rel_l2(decode(msg), tensor) < 0.01


def test_garbled_outlier_fields_are_refused() -> None:
    msg = encode(torch.randn(4, 64), CodecId.INT8_HADAMARD)
    bad_index = pb.Tensor()
    bad_index.CopyFrom(msg)
    bad_index.outlier_indices = (b"\xff\xff" * 8)[: len(msg.outlier_indices)]
    with pytest.raises(MalformedTensorError, match="outside rows of length 64"):
        decode(bad_index)
    short = pb.Tensor()
    short.CopyFrom(msg)
    short.outlier_values = msg.outlier_values[:-4]
    with pytest.raises(MalformedTensorError, match="outlier_values"):
        decode(short)
    too_many = pb.Tensor()
    too_many.CopyFrom(msg)
    too_many.outliers = 1000
    with pytest.raises(MalformedTensorError, match="outliers=1000"):
        decode(too_many)


def test_unknown_scale_dtype_is_refused() -> None:
    msg = encode(torch.randn(4, 64), CodecId.INT8_HADAMARD)
    msg.scale_dtype = pb.DTYPE_INT64
    with pytest.raises(MalformedTensorError, match="scale_dtype"):
        decode(msg)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec_id", [CodecId.INT8_HADAMARD, CodecId.INT8_BLOCKWISE_LINEAR, CodecId.BFLOAT16])
@pytest.mark.parametrize("tokens", [1, 128, 1024])  # a decode step and a short prompt code on the host, not 1024
def test_cuda_tensors_encode_and_decode_onto_the_device(codec_id: CodecId, tokens: int) -> None:
    tensor = torch.randn(4, tokens, 576, device="cuda")
    decoded = decode(encode(tensor, codec_id), device="cuda")
    assert decoded.device.type == "cuda"
    assert rel_l2(decoded, tensor) < 0.01
