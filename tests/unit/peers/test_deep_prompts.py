"""Deep prompts on a tiny random span (peers/task_runner.py, BlockSpan.run): a forward adds row i of the prompts to the
first pre_seq_len positions entering block i, batched jobs keep their own prompts, a backward's prompt gradient
equals autograd through that sum (summed over the batch), and prompts that do not fit are refused."""

from __future__ import annotations

import pytest
import torch

from peers.task_runner import BackwardJob, ForwardJob, TaskRunner
from swarm.errors import InvalidRequest

PRE = 2


def by_hand(span, hidden: torch.Tensor, prompts: torch.Tensor) -> torch.Tensor:
    cos, sin = span.rotary(0, hidden.shape[1], hidden.dtype)
    for index, block in enumerate(span.blocks):
        hidden = torch.cat([hidden[:, :PRE] + prompts[index], hidden[:, PRE:]], dim=1)
        hidden = block(hidden, cos, sin, None)
    return hidden


def test_forward_and_backward_with_deep_prompts(tiny_span) -> None:
    backend = TaskRunner(tiny_span, 4096)
    generator = torch.Generator().manual_seed(0)
    hidden, grad_out = torch.randn(2, 5, 64, generator=generator), torch.randn(2, 5, 64, generator=generator)
    prompts = torch.randn(4, PRE, 64, generator=generator)
    other = torch.randn(4, PRE, 64, generator=generator)
    got, got_other = backend.forward(
        [ForwardJob(hidden, 0, range(0, 4), None, prompts), ForwardJob(hidden, 0, range(0, 4), None, other)]
    )
    assert torch.allclose(got, by_hand(tiny_span, hidden, prompts), atol=1e-5)
    assert torch.allclose(got_other, by_hand(tiny_span, hidden, other), atol=1e-5)
    assert not torch.allclose(got, backend.forward([ForwardJob(hidden, 0, range(0, 4))])[0], atol=1e-3)

    result = backend.backward(BackwardJob(hidden, grad_out, 0, range(0, 4), None, prompts))
    inputs, leaf = hidden.clone().requires_grad_(True), prompts.clone().requires_grad_(True)
    expected = torch.autograd.grad(by_hand(tiny_span, inputs, leaf), [inputs, leaf], grad_out)
    assert torch.allclose(result.grad_inputs, expected[0], atol=1e-5)
    assert result.grad_prompts is not None and torch.allclose(result.grad_prompts, expected[1], atol=1e-5)
    assert result.adapter_grads == {}
    assert backend.backward(BackwardJob(hidden, grad_out, 0, range(0, 4))).grad_prompts is None


def test_a_sub_range_uses_its_own_rows(tiny_span) -> None:
    backend = TaskRunner(tiny_span, 4096)
    hidden, prompts = torch.randn(1, 4, 64), torch.randn(4, PRE, 64)
    whole = backend.forward([ForwardJob(hidden, 0, range(0, 4), None, prompts)])[0]
    half = backend.forward([ForwardJob(hidden, 0, range(0, 2), None, prompts[:2])])[0]
    assert torch.allclose(backend.forward([ForwardJob(half, 0, range(2, 4), None, prompts[2:])])[0], whole, atol=1e-5)


@pytest.mark.parametrize(
    ("shape", "message"),
    [((3, PRE, 64), "prompts must be"), ((4, 6, 64), "prompts must be"), ((4, PRE, 32), "prompts must be")],
)
def test_prompts_that_do_not_fit_are_refused(tiny_span, shape, message) -> None:
    backend = TaskRunner(tiny_span, 4096)
    with pytest.raises(InvalidRequest, match=message):
        backend.check_prompts(torch.zeros(shape), range(0, 4), seq=5)
    with pytest.raises(InvalidRequest, match="finite"):
        backend.check_prompts(torch.full((4, PRE, 64), float("nan")), range(0, 4), seq=5)
