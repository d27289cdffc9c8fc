"""The dense optimizer: Adam for the deep parameters, Adagrad for the wide ones, in one optimizer.

The wide part of every model (the bias and the linear term over dense features) is what an online
logistic regression learns; it wants per-coordinate Adagrad steps that shrink as evidence
accumulates, at the wide learning rate, like the ids' first-order weights in the store. Adam's
steps do not shrink with the gradient, so at small batches Adam jitters the bias and the dense
weights by about lr every step. The deep parameters (MLP, cross layers) keep Adam.

One optimizer with a rule per parameter group keeps the rest simple: snapshots save its
state_dict, merges average every state tensor (Adam's moments, Adagrad's sums).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainer.errors import TrainerError

RULES = ("adam", "adagrad")


class WideDeepOptimizer(torch.optim.Optimizer):
    """Param groups carry "rule" ("adam" or "adagrad") and "lr". Adam matches torch.optim.Adam
    (no weight decay, no amsgrad); Adagrad matches torch.optim.Adagrad (no decay, eps 1e-10)."""

    def __init__(self, groups: Iterable[dict[str, Any]], betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(list(groups), {"lr": 1e-3, "rule": "adam", "betas": betas})
        for group in self.param_groups:
            if group["rule"] not in RULES:
                raise TrainerError(f"WideDeepOptimizer: param group rule {group['rule']!r}; use one of {list(RULES)}")

    def init_state(self) -> None:
        """Give every parameter its (zero) state, so replicas that have not stepped yet can merge."""
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if state:
                    continue
                state["step"] = torch.tensor(0.0)
                if group["rule"] == "adam":
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                else:
                    state["sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        self.init_state()
        for group in self.param_groups:
            lr = group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, state = p.grad, self.state[p]
                state["step"] += 1
                t = float(state["step"])
                if group["rule"] == "adagrad":
                    state["sum"].addcmul_(g, g)
                    p.addcdiv_(g, state["sum"].sqrt().add_(1e-10), value=-lr)
                    continue
                beta1, beta2 = group["betas"]
                state["exp_avg"].lerp_(g, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(1e-8)
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))
        return loss


def wide_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The wide part's parameters: the bias and the dense features' linear term."""
    return [model.get_parameter("bias"), model.get_parameter("dense_linear.weight")]


def wide_deep_optimizer(model: nn.Module, lr: float, wide_lr: float) -> WideDeepOptimizer:
    wide = wide_parameters(model)
    deep = [p for p in model.parameters() if all(p is not w for w in wide)]
    groups = [{"params": wide, "lr": wide_lr, "rule": "adagrad"}]
    if deep:
        groups.append({"params": deep, "lr": lr, "rule": "adam"})
    return WideDeepOptimizer(groups)
