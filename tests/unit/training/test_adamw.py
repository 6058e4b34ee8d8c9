"""The stages' AdamW (swarm/training/adamw.py) against torch.optim.AdamW: the same update, the same state."""

from __future__ import annotations

import copy

import pytest
import torch

from swarm.training.adamw import AdamW

HYPER = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _pair(make):
    torch.manual_seed(0)
    shapes = [(37, 11), (5,), (3, 4, 2)]
    start = [torch.randn(shape) for shape in shapes]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    return ours, theirs, make(ours, AdamW), make(theirs, torch.optim.AdamW)


def _groups(params, cls):  # decay on the matrices, none on the vector (as for norms and biases)
    return cls([{"params": [params[0], params[2]]}, {"params": [params[1]], "weight_decay": 0.0}], **HYPER)


def _step_both(ours, theirs, opt_ours, opt_theirs, steps: int, skip_last: bool = False) -> None:
    for _ in range(steps):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn_like(a)
            a.grad, b.grad = grad.clone(), grad.clone()
        if skip_last:  # a parameter without a gradient this step is left alone, its state too
            ours[-1].grad = theirs[-1].grad = None
        opt_ours.step()
        opt_theirs.step()


def _assert_same(ours, theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_update_is_torchs_adamw() -> None:
    ours, theirs, opt_ours, opt_theirs = _pair(_groups)
    _step_both(ours, theirs, opt_ours, opt_theirs, 30)
    _step_both(ours, theirs, opt_ours, opt_theirs, 5, skip_last=True)
    _assert_same(ours, theirs)
    state_ours, state_theirs = opt_ours.state_dict()["state"], opt_theirs.state_dict()["state"]
    assert state_ours.keys() == state_theirs.keys()
    for index, state in state_ours.items():
        assert sorted(state) == sorted(state_theirs[index]) == ["exp_avg", "exp_avg_sq", "step"]
        assert float(state["step"]) == float(state_theirs[index]["step"])
        torch.testing.assert_close(state["exp_avg_sq"], state_theirs[index]["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_state_moves_between_the_two() -> None:
    """A state saved by torch's AdamW (a checkpoint, a sibling's download) loads into this one and the steps go on
    the same, and the other way round."""
    ours, theirs, opt_ours, opt_theirs = _pair(_groups)
    _step_both(ours, theirs, opt_ours, opt_theirs, 10)
    # copies, as a download or a checkpoint gives (torch loads a state's tensors without copying them)
    opt_ours.load_state_dict(copy.deepcopy(opt_theirs.state_dict()))
    opt_theirs.load_state_dict(copy.deepcopy(opt_ours.state_dict()))
    _step_both(ours, theirs, opt_ours, opt_theirs, 10)
    _assert_same(ours, theirs)
    opt_ours.zero_grad()
    assert all(p.grad is None for p in ours)


def test_closure_and_bad_hyperparameters() -> None:
    weight = torch.ones(3, requires_grad=True)
    optimizer = AdamW([weight], lr=0.1, weight_decay=0.0)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = (weight**2).sum()
        loss.backward()
        return loss

    assert float(optimizer.step(closure).detach()) == 3.0
    assert torch.all(weight < 1.0)
    for bad in ({"lr": -1.0}, {"betas": (0.9, 1.0)}, {"eps": -1e-8}, {"weight_decay": -0.1}):
        with pytest.raises(ValueError, match="AdamW"):
            AdamW([weight], **bad)
