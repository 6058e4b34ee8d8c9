"""peers/lora.py on a tiny random span: a forward with an adapter equals the span with merged weights
W + scaling * B @ A; a backward's adapter gradients equal autograd through the merged weights; the cache answers
AdapterNotFound for what it does not hold, keeps each uploader's copies apart within a byte budget, and uploads of
the wrong shape are refused."""

from __future__ import annotations

import pytest
import torch

from peers.adapter_budget import AdapterBudget
from peers.lora import IDLE_EVICT_S, AdapterCache, AdapterKey, LoraWeights, check_shapes
from peers.task_runner import BackwardJob, ForwardJob, TaskRunner
from swarm.errors import AdapterNotFound, InvalidRequest, LimitExceeded

RANK, SCALING = 4, 2.0
KEY = AdapterKey("a", 1)


def lora_weights(span, key: AdapterKey = KEY) -> LoraWeights:
    weights = LoraWeights(key, 0, 4, SCALING)
    generator = torch.Generator().manual_seed(1)
    for block in range(4):
        for path in ("self_attn.q_proj", "self_attn.v_proj"):
            linear = span.blocks[block].get_submodule(path)
            a = torch.randn(RANK, linear.in_features, generator=generator) * 0.1
            b = torch.randn(linear.out_features, RANK, generator=generator) * 0.1
            weights.tensors |= {f"{block}.{path}.lora_A": a, f"{block}.{path}.lora_B": b}
    return weights


def merged(span, weights: LoraWeights, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = dict(span.named_parameters())
    for block, path, prefix in weights.pairs(range(0, 4)):
        name = f"blocks.{block}.{path}.weight"
        params[name] = params[name] + SCALING * tensors[f"{prefix}.lora_B"] @ tensors[f"{prefix}.lora_A"]
    return params


def test_forward_and_backward_equal_merged_weights(tiny_span) -> None:
    backend, weights = TaskRunner(tiny_span, 4096), lora_weights(tiny_span)
    hidden, grad_out = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    got = backend.forward([ForwardJob(hidden, 0, range(0, 4), weights)])[0]
    expected = torch.func.functional_call(tiny_span, merged(tiny_span, weights, weights.tensors), (hidden,))
    assert torch.allclose(got, expected, atol=1e-5)
    assert not torch.allclose(got, backend.forward([ForwardJob(hidden, 0, range(0, 4))])[0], atol=1e-3)

    result = backend.backward(BackwardJob(hidden, grad_out, 0, range(0, 4), weights))
    grad_inputs, grads = result.grad_inputs, result.adapter_grads
    leaves = {name: t.clone().requires_grad_(True) for name, t in weights.tensors.items()}
    inputs = hidden.clone().requires_grad_(True)
    out = torch.func.functional_call(tiny_span, merged(tiny_span, weights, leaves), (inputs,))
    expected_grads = torch.autograd.grad(out, [inputs, *leaves.values()], grad_out)
    assert torch.allclose(grad_inputs, expected_grads[0], atol=1e-5)
    assert sorted(grads) == sorted(leaves)
    for name, expected_grad in zip(leaves, expected_grads[1:], strict=True):
        assert torch.allclose(grads[name], expected_grad, atol=1e-5), name
    assert all(not isinstance(m, torch.nn.Module) or type(m).__name__ != "_LoraLinear" for m in tiny_span.modules())


def test_cache_holds_one_version_per_adapter_and_evicts_the_owners_oldest(tiny_span) -> None:
    size = lora_weights(tiny_span).nbytes
    cache = AdapterCache(AdapterBudget(per_client=2 * size, total=100 * size))
    cache.put("alice", lora_weights(tiny_span, AdapterKey("a", 1)))
    assert cache.get("alice", AdapterKey("a", 1), range(0, 4)).key == AdapterKey("a", 1)
    with pytest.raises(AdapterNotFound):
        cache.get("alice", AdapterKey("a", 2), range(0, 4))  # a newer version must be uploaded
    cache.put("alice", lora_weights(tiny_span, AdapterKey("b", 1)))
    cache.put("alice", lora_weights(tiny_span, AdapterKey("c", 1)))
    with pytest.raises(AdapterNotFound):
        cache.get("alice", AdapterKey("a", 1), range(0, 4))  # evicted: alice's least recently used
    assert cache.budget.held("alice") == 2 * size


def test_one_uploader_never_reaches_anothers_uploads(tiny_span) -> None:
    """Same id, another uploader: a separate copy. Another's uploads are evicted only once idle for IDLE_EVICT_S;
    until then a full peer refuses naming the limit."""
    size, now = lora_weights(tiny_span).nbytes, [0.0]
    cache = AdapterCache(AdapterBudget(per_client=3 * size, total=4 * size), clock=lambda: now[0])
    cache.put("alice", lora_weights(tiny_span, KEY))
    with pytest.raises(AdapterNotFound):
        cache.get("bob", KEY, range(0, 4))  # alice's upload is not bob's
    cache.put("bob", lora_weights(tiny_span, AdapterKey("b", 1)))
    cache.put("bob", lora_weights(tiny_span, AdapterKey("c", 1)))
    cache.put("bob", lora_weights(tiny_span, AdapterKey("d", 1)))
    with pytest.raises(LimitExceeded, match=r"adapter_bytes exceeded.*uploads of all clients hold"):
        cache.put("carol", lora_weights(tiny_span, AdapterKey("e", 1)))
    assert cache.get("alice", KEY, range(0, 4)).key == KEY  # still alice's, still held
    cache.put("bob", lora_weights(tiny_span, AdapterKey("e", 1)))  # bob makes room among his own
    with pytest.raises(AdapterNotFound):
        cache.get("bob", AdapterKey("b", 1), range(0, 4))
    assert cache.get("alice", KEY, range(0, 4)).key == KEY
    with pytest.raises(LimitExceeded, match="adapter_bytes_per_client"):
        AdapterCache(AdapterBudget(per_client=size - 1, total=4 * size)).put("alice", lora_weights(tiny_span))
    now[0] = IDLE_EVICT_S + 1  # everyone idle now: a newcomer may take the least recently used (bob's c)
    cache.put("carol", lora_weights(tiny_span, AdapterKey("e", 1)))
    with pytest.raises(AdapterNotFound):
        cache.get("bob", AdapterKey("c", 1), range(0, 4))
    assert cache.get("alice", KEY, range(0, 4)).key == KEY
    assert cache.budget.total_held == 4 * size


def test_uploads_that_do_not_fit_the_layers_are_refused(tiny_span) -> None:
    weights = lora_weights(tiny_span)
    weights.tensors["0.self_attn.q_proj.lora_A"] = torch.randn(RANK, 63)
    with pytest.raises(InvalidRequest, match=r"q_proj\.lora_A"):
        check_shapes(tiny_span, weights)
    weights = lora_weights(tiny_span)
    weights.tensors["0.self_attn.q_proj.lora_B"] = torch.full((64, RANK), float("nan"))
    with pytest.raises(InvalidRequest, match="NaN"):
        check_shapes(tiny_span, weights)
