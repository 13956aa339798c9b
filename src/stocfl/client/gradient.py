"""The gradient query: a client's full-batch gradient of its train risk at given weights,
nabla r_i(w) (CFL's gradient variant, Sattler et al. 2020, Algorithm 2, line 3).

In evaluation mode (dropout off, BatchNorm on its running statistics): the risk as the client
evaluates it, the same on every engine and for any chunking of the data. The buffers' entries
of the gradient are 0. A registered task kind (``query.gradient``): every executor runs it and
the Flower codec carries it from its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stocfl.client.tasks import (
    BadResult,
    ClientData,
    _count,
    check_vector,
    check_weights,
    largest_entry,
    largest_sent,
    register_task,
)


@dataclass(frozen=True, eq=False)
class Gradient:
    """nabla_w (1/|D_i|) sum_s l(h_w(x_s), y_s) over the client's train data."""

    client: int
    weights: torch.Tensor


@dataclass(frozen=True, eq=False)
class Gradiented:
    gradient: torch.Tensor  # (P,)
    n_samples: int


def full_gradient(c: ClientData, t: Gradient) -> Gradiented:
    """The reference: autograd through the model, a chunk of samples at a time, each chunk's
    summed loss so that the chunks add up to the mean."""
    model = c.model
    check_weights("gradient", t, model.n_params)
    n = len(c.y)
    total = torch.zeros(model.n_params, dtype=torch.float64, device=t.weights.device)
    if n:
        x = model.layout(c.x)
        chunk = model.eval_chunk(x)
        for a in range(0, n, chunk):
            w = t.weights.detach().clone().requires_grad_(True)
            loss = model.per_sample_loss(model.forward(w, x[a : a + chunk]), c.y[a : a + chunk]).sum()
            (g,) = torch.autograd.grad(loss, w)
            total += g.double()
        total /= n
    total[model.n_trainable :] = 0.0
    return Gradiented(total.float(), n)


def check_gradiented(t: Gradient, r: Gradiented, train_size: int, test_size: int) -> Gradiented:
    if not isinstance(r.gradient, torch.Tensor):
        raise BadResult("gradient missing")
    g = check_vector(r.gradient, "gradient", t.weights.numel())  # its size is bounded by out_of_bound
    _count(r.n_samples, train_size, "n_samples")
    return Gradiented(g, r.n_samples)


def moved_gradient(t: Gradient, r: Gradiented) -> tuple[float, float]:
    """A gradient is a move from nothing: its largest entry, beside the model's."""
    return largest_entry(r.gradient), largest_sent(t.weights)


register_task(
    Gradient,
    Gradiented,
    full_gradient,
    "query.gradient",
    check_gradiented,
    reply_size=lambda t: t.weights.numel(),
    moved=moved_gradient,
)
