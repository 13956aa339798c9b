"""Local training: the mini-batch order every executor follows, and plain SGD on one client
(the reference that the batched executor is checked against)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from stocfl.models import FlatModel


def batch_plan(n: int, epochs: int, batch_size: int, seed: int) -> list[list[torch.Tensor] | None]:
    """Per epoch, the mini-batches as index tensors; ``None`` for a full-batch epoch.

    Every executor takes the order from here, which is why they agree to float rounding."""
    if batch_size == 0 or batch_size >= n:
        return [None] * epochs
    g = torch.Generator().manual_seed(int(seed))
    return [list(torch.split(torch.randperm(n, generator=g), batch_size)) for _ in range(epochs)]


def local_sgd(model: FlatModel, x, y, w, epochs, batch_size, lr, seed, center=None, mu: float = 0.0,
              grad: Callable | None = None):
    """E epochs of mini-batch SGD on f(w) + (mu/2)||w - center||^2, in the order of batch_plan.

    ``grad(w, x_flat, y, n_classes)``, when given, is an exact closed-form gradient used
    instead of autograd (the linear anchor's fast path)."""
    w = w.detach().clone()
    if grad is not None:
        x = x.flatten(1)
        n_classes = len(w) // (x.shape[1] + 1)
    for epoch in batch_plan(len(y), epochs, batch_size, seed):
        for idx in epoch or [None]:
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])
            if grad is not None:
                g = grad(w, xb, yb, n_classes)
            else:
                wl = w.requires_grad_(True)
                (g,) = torch.autograd.grad(F.cross_entropy(model.forward(wl, xb), yb), wl)
                w = wl.detach()
            if center is not None and mu:
                g.add_(w - center, alpha=mu)
            w.add_(g, alpha=-lr)
    return w
