"""AdamW for stage replicas, without torch's compiler machinery.

torch.optim's optimizers import `torch._dynamo` the first time any of their methods runs (`step` imports it
outright, `add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` are wrapped to be skipped by
torch.compile). That import costs a fresh process about 1 s of CPU, a quarter of what a replica that Ray restarts
spends before it serves again, on cores its siblings are training on. Stages are never compiled, so this class
runs torch's own methods unwrapped and does the AdamW update itself with the `_foreach` kernels.

The update is decoupled weight decay, then Adam with bias correction (Loshchilov & Hutter), like
`torch.optim.AdamW` to rounding; the state has torch's names and layout (`step`, `exp_avg`, `exp_avg_sq`), so
hivemind's state downloads and averaging read it unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


def _unwrapped(method: Callable) -> Callable:
    """The method under torch's `_disable_dynamo` wrapper (functools.wraps keeps it as `__wrapped__`)."""
    return getattr(method, "__wrapped__", method)


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"AdamW: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    add_param_group = _unwrapped(torch.optim.Optimizer.add_param_group)
    zero_grad = _unwrapped(torch.optim.Optimizer.zero_grad)
    state_dict = _unwrapped(torch.optim.Optimizer.state_dict)
    load_state_dict = _unwrapped(torch.optim.Optimizer.load_state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update(group, params)
        return loss

    def _update(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if any(p.grad.is_sparse for p in params):
            raise RuntimeError("AdamW does not take sparse gradients")
        states = [self._state(p) for p in params]
        grads = [p.grad for p in params]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]
        (beta1, beta2), lr = group["betas"], group["lr"]
        for state in states:
            state["step"] += 1
        if group["weight_decay"]:
            torch._foreach_mul_(params, 1.0 - lr * group["weight_decay"])
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        steps = [float(state["step"]) for state in states]
        denominators = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denominators, [math.sqrt(1.0 - beta2**step) for step in steps])
        torch._foreach_add_(denominators, group["eps"])
        torch._foreach_addcdiv_(params, exp_avgs, denominators, [-lr / (1.0 - beta1**step) for step in steps])

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return state
