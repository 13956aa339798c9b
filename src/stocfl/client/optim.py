"""Local optimizers as pure functions of (weights, gradient, state), so that one client (a
vector of P weights) and a stack of clients ((C, P), the batched executor) take the same step.

They follow ``torch.optim.SGD`` (momentum without dampening or Nesterov) and ``torch.optim.Adam``
(no AMSGrad; weight decay as an L2 term added to the gradient, as both do), and start from a
fresh state in every local training (``tests/test_optim.py`` compares them with torch.optim).
The plain case (SGD, no momentum, no weight decay) never comes here: the executors keep their
original update ``w -= lr * g``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Optimizer:
    name: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8

    @property
    def plain(self) -> bool:
        return self.name == "sgd" and self.momentum == 0.0 and self.weight_decay == 0.0

    def init(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """A fresh state for weights ``w`` (shape (P,) or (C, P))."""
        if self.name == "adam":
            return {
                "m": torch.zeros_like(w),
                "v": torch.zeros_like(w),
                "t": torch.zeros(*w.shape[:-1], 1, device=w.device),
            }
        return {"buf": torch.zeros_like(w), "t": torch.zeros(*w.shape[:-1], 1, device=w.device)}

    def step(
        self, w: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], active: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Updates ``w`` and ``state`` in place with gradient ``g``; rows whose ``active`` is 0
        (a client out of mini-batches in the batched executor) keep their weights and state."""
        if self.weight_decay:
            g = g + self.weight_decay * w
        t = state["t"] + (1.0 if active is None else active)
        if self.name == "adam":
            m = state["m"].lerp(g, 1 - self.beta1)  # torch's own operations, in its order
            v = (self.beta2 * state["v"]).addcmul_(g, g, value=1 - self.beta2)
            tt = t.clamp(min=1.0).double()
            step_size = (self.lr / (1 - self.beta1**tt)).float()
            bias2_sqrt = (1 - self.beta2**tt).sqrt().float()
            update = step_size * m / ((v.sqrt() / bias2_sqrt) + self.eps)
            new = {"m": m, "v": v}
        else:
            buf = torch.where(state["t"] == 0, g, self.momentum * state["buf"] + g) if self.momentum else g
            update = self.lr * buf
            new = {"buf": buf}
        if active is None:
            w.sub_(update)
            state.update(new, t=t)
        else:
            w.sub_(active * update)
            for k, value in new.items():
                state[k] = torch.where(active > 0, value, state[k])
            state["t"] = t
        return w
