"""Local training: the mini-batch order every executor follows, and plain SGD on one client
(the reference that the batched executor is checked against)."""

from __future__ import annotations

from typing import Callable

import torch

from stocfl.models import FlatModel
from stocfl.optim import Optimizer


def batch_plan(n: int, epochs: int, batch_size: int, seed: int) -> list[list[torch.Tensor] | None]:
    """Per epoch, the mini-batches as index tensors; ``None`` for a full-batch epoch.

    Every executor takes the order from here, which is why they agree to float rounding."""
    if batch_size == 0 or batch_size >= n:
        return [None] * epochs
    g = torch.Generator().manual_seed(int(seed))
    return [list(torch.split(torch.randperm(n, generator=g), batch_size)) for _ in range(epochs)]


def local_sgd(model: FlatModel, x, y, w, epochs, batch_size, lr, seed, center=None, mu: float = 0.0,
              grad: Callable | None = None, opt: Optimizer | None = None):
    """E epochs of mini-batch SGD on f(w) + (mu/2)||w - center||^2, in the order of batch_plan.

    ``grad(w, x_flat, y, n_classes)``, when given, is an exact closed-form gradient used
    instead of autograd (the linear anchor's fast path). ``opt``: another optimizer than plain
    SGD (momentum, weight decay, Adam; ``stocfl.optim``), from a fresh state."""
    if model.has_buffers and grad is None:
        return _local_sgd_buffers(model, x, y, w, epochs, batch_size, lr, seed, center, mu, opt)
    w = w.detach().clone()
    state = opt.init(w) if opt is not None and not opt.plain else None
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
                (g,) = torch.autograd.grad(model.mean_loss(model.forward(wl, xb), yb), wl)
                w = wl.detach()
            if center is not None and mu:
                g.add_(w - center, alpha=mu)
            if state is None:
                w.add_(g, alpha=-lr)
            else:
                opt.step(w, g, state)
    return w


def _local_sgd_buffers(model: FlatModel, x, y, w, epochs, batch_size, lr, seed, center, mu, opt):
    """local_sgd for a model with buffers (BatchNorm): the step acts on the parameters; the
    buffers take the running statistics of every mini-batch, as in ``module.train()``."""
    w = w.detach().clone()
    p = model.n_trainable
    params = w[:p]  # a view: steps write into w
    state = opt.init(params) if opt is not None and not opt.plain else None
    for epoch in batch_plan(len(y), epochs, batch_size, seed):
        for idx in epoch or [None]:
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])
            buffers = model.split_buffers(w)
            leaf = params.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(model.mean_loss(model.forward_train(leaf, buffers, xb), yb), leaf)
            if center is not None and mu:
                g.add_(params - center[:p], alpha=mu)
            if state is None:
                params.add_(g, alpha=-lr)
            else:
                opt.step(params, g, state)
            w[p:] = torch.cat([t.reshape(-1) for t in buffers])
    return w
