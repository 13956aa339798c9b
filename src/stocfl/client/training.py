"""Local training: its settings as one value (:class:`LocalTraining`), the mini-batch order
every executor follows, and SGD on one client (the reference that the batched executor is
checked against)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stocfl.client.models import FlatModel
from stocfl.client.optim import Optimizer
from stocfl.config import TrainConfig


@dataclass(frozen=True)
class LocalTraining:
    """How a client trains: E passes (``epochs``) over its train set in shuffled mini-batches of
    B samples (``batch_size``; 0 = the full batch), every step taken by ``optimizer`` (the
    learning rate eta and, where set, momentum, weight decay or Adam's betas; a fresh state in
    every local training). The config's ``[train]`` as one value: the algorithm's
    :class:`~stocfl.algorithms.Context` holds it and every training task carries it."""

    epochs: int = 1
    batch_size: int = 0
    optimizer: Optimizer = Optimizer()

    @classmethod
    def from_config(cls, train: TrainConfig) -> LocalTraining:
        """The config's ``[train]`` section as a value."""
        beta1, beta2 = train.betas
        return cls(
            train.epochs,
            train.batch_size,
            Optimizer(train.optimizer, train.lr, train.momentum, train.weight_decay, beta1, beta2),
        )

    @classmethod
    def sgd(cls, epochs: int, batch_size: int, lr: float) -> LocalTraining:
        """Plain SGD (no momentum, no weight decay) at learning rate ``lr``."""
        return cls(epochs, batch_size, Optimizer("sgd", lr))


def batch_plan(n: int, epochs: int, batch_size: int, seed: int) -> list[list[torch.Tensor] | None]:
    """Per epoch, the mini-batches as index tensors; ``None`` for a full-batch epoch.

    Every executor takes the order from here, which is why they agree to float rounding."""
    if batch_size == 0 or batch_size >= n:
        return [None] * epochs
    g = torch.Generator().manual_seed(int(seed))
    return [list(torch.split(torch.randperm(n, generator=g), batch_size)) for _ in range(epochs)]


def stacked_batch(
    plans, epoch: int, step: int, steps: list[int], sizes: list[int], device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step`` of ``epoch`` for a stack of clients following their ``plans``
    (:func:`batch_plan`): sample indices (clients x widest batch, padded with 0) and a mask of
    the real ones. A client out of batches gets an empty row."""
    batches = []
    for i, p in enumerate(plans):
        if step >= steps[i]:
            batches.append(torch.zeros(0, dtype=torch.long))
        else:
            batches.append(torch.arange(sizes[i]) if p[epoch] is None else p[epoch][step])
    width = max(len(b) for b in batches)
    idx = torch.zeros((len(plans), width), dtype=torch.long)
    mask = torch.zeros((len(plans), width))
    for i, b in enumerate(batches):
        idx[i, : len(b)] = b
        mask[i, : len(b)] = 1.0
    return idx.to(device), mask.to(device)


def rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` for a 1-D index: ``index_select`` where ``t`` has the default strides (the
    same values and strides at a fraction of advanced indexing's cost, which weighs on a small
    model's step), ``t[idx]`` otherwise: it keeps a channels-last layout, which index_select
    does not (one channel's images are contiguous either way, and only their strides tell)."""
    return rows_of(t)(idx)


def rows_of(t: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """:func:`rows` of ``t`` as a function of the index, its strides looked at once."""
    if t.stride() == _default_strides(t.shape):
        return functools.partial(torch.index_select, t, 0)
    return t.__getitem__


def _default_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def local_sgd(
    model: FlatModel,
    x,
    y,
    w,
    local: LocalTraining,
    seed,
    center=None,
    mu: float = 0.0,
    grad: Callable | None = None,
    sample_weights: torch.Tensor | None = None,
):
    """``local.epochs`` epochs of mini-batch steps of ``local.optimizer`` on
    f(w) + (mu/2)||w - center||^2, in the order of batch_plan; plain SGD steps each parameter
    in place, another optimizer (momentum, weight decay, Adam; ``stocfl.client.optim``) starts
    from a fresh state.

    ``grad(w, x_flat, y, n_classes, out)``, when given, is an exact closed-form gradient
    written into ``out``, used instead of autograd (the linear anchor's fast path).
    ``sample_weights`` (one per sample), when given, make a batch's loss sum_b q_b l_b / |B| in
    place of the mean (the mixture family's M-step)."""
    if grad is not None and sample_weights is not None:
        raise ValueError("local_sgd: a closed-form gradient takes no sample weights")
    opt, lr = local.optimizer, local.optimizer.lr
    w = w.detach().clone()
    x = model.layout(x)  # once per client: the mini-batches gathered from it keep its layout
    p = model.n_trainable  # the step acts on the parameters; buffers take BatchNorm's running statistics
    params = w[:p]  # a view: steps write into w
    state = None if opt.plain else opt.init(params)
    if grad is not None:
        x = x.flatten(1)
        n_classes = len(w) // (x.shape[1] + 1)
        flat = torch.empty_like(params)  # each step's gradient, written over by the next
        flat_views = model.param_views(flat)
    # Autograd gives one gradient per parameter tensor, and plain SGD steps each in place: no
    # flat gradient is concatenated (for a 1.6M-parameter CNN that copy was an eighth of a step).
    views = model.param_views(params)
    centers = model.param_views(center) if center is not None and mu else None
    x_rows, y_rows = rows_of(x), rows_of(y)
    q_rows = rows_of(sample_weights) if sample_weights is not None else None
    with _seeded(seed, x.device) if model.random else contextlib.nullcontext():
        for epoch in batch_plan(len(y), local.epochs, local.batch_size, seed):
            batches: list[torch.Tensor | None] = list(epoch) if epoch else [None]  # None: the whole set
            for idx in batches:
                xb, yb = (x, y) if idx is None else (x_rows(idx), y_rows(idx))
                gs: Sequence[torch.Tensor]
                if grad is not None:
                    grad(params, xb, yb, n_classes, flat)
                    gs = flat_views
                else:
                    leaves = [v.detach().requires_grad_(True) for v in views]
                    buffers = model.split_buffers(w) if model.has_buffers else []  # [] : train mode, no buffers
                    logits = model.forward_tensors(leaves, buffers, xb)
                    if sample_weights is None:
                        loss = model.mean_loss(logits, yb)
                    else:
                        qb = sample_weights if idx is None or q_rows is None else q_rows(idx)
                        loss = (model.per_sample_loss(logits, yb) * qb).sum() / len(yb)
                    gs = torch.autograd.grad(loss, leaves)
                    if buffers:  # after the gradient: w shares its storage with the leaves
                        w[p:] = torch.cat([t.reshape(-1) for t in buffers])
                if centers is not None:
                    for g, v, c in zip(gs, views, centers):
                        g.add_(v - c, alpha=mu)
                if state is None:
                    for v, g in zip(views, gs):
                        v.add_(g, alpha=-lr)
                else:
                    opt.step(params, flat if grad is not None else torch.cat([g.reshape(-1) for g in gs]), state)
    return w


@contextlib.contextmanager
def _seeded(seed: int, device: torch.device):
    """Dropout's draws from a stream of the task's own seed, whatever ran before (the caller's
    generator state is put back after): the same seed gives the same numbers, and a client's
    training does not depend on the others'."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(int(seed))
        yield
