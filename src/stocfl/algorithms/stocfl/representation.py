"""StoCFL's client computation: the representation Psi(D_i) from a fixed anchor model (Zeng et
al., 2023, section 3.2), a registered task kind (``query.represent``).

``gradient``: g = the gradient of the anchor's mean loss on the whole train set (the paper's
text); ``update``: g = anchor minus the anchor after E_psi epochs of local SGD (the authors'
code: plain SGD with its own E_psi, B_psi, eta_psi, not the run's ``[train]``; the task carries
them as a :class:`~stocfl.client.training.LocalTraining`). The anchor is the run's model at
w_0 (``train``) or a linear softmax model on the raw inputs (``linear``, paper Fig. 2, with an
exact closed-form gradient). With ``dim`` > 0 the client sends a seeded count-sketch
projection of g. The result is g / ||g||; the server re-normalises it again (a client's norm
is never trusted).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch

from stocfl.client.models import FlatModel, linear_model
from stocfl.client.tasks import BadResult, ClientData, _count, check_vector, register_task
from stocfl.client.training import LocalTraining, local_sgd
from stocfl.errors import UserError


@dataclass(frozen=True, eq=False)
class Represent:
    """The client's data representation Psi(D) from the fixed ``anchor`` (see the module
    docstring); ``local`` is how the ``update`` kind trains (E_psi, B_psi, eta_psi), ``seed``
    fixes its mini-batch order, ``projection_seed`` the count sketch (the same for every
    client)."""

    client: int
    anchor: torch.Tensor
    kind: Literal["gradient", "update"] = "gradient"
    anchor_model: Literal["train", "linear"] = "train"
    local: LocalTraining = LocalTraining.sgd(20, 50, 0.1)
    seed: int = 0
    dim: int = 0
    projection_seed: int = 0


@dataclass(frozen=True, eq=False)
class Represented:
    psi: torch.Tensor  # unit vector, or all zeros when the gradient vanished
    n_samples: int


def count_sketch(v: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """A seeded count-sketch random projection R v with R of shape (dim, len(v)): coordinate j
    goes to bucket h(j) with sign s(j). Inner products are preserved in expectation
    (E <Rx, Ry> = <x, y>); the same (dim, seed, len) gives the same R on every client."""
    g = torch.Generator().manual_seed(int(seed))
    buckets = torch.randint(0, dim, (v.numel(),), generator=g).to(v.device)
    signs = torch.randint(0, 2, (v.numel(),), generator=g).to(v.device, v.dtype).mul_(2).sub_(1)
    return torch.zeros(dim, dtype=v.dtype, device=v.device).index_add_(0, buckets, v * signs)


def linear_softmax_grad(
    w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, n_classes: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact gradient of the mean cross-entropy of a linear softmax model (weight (C, D) then
    bias (C,), flattened) without autograd: dW = (p - Y)^T x / n, db = mean(p - Y); written
    into ``out`` (a flat tensor like ``w``) where given. A Psi takes some sixty of these steps
    on a batch of 50, where each operation's call costs about what its arithmetic does: the
    one-hot is subtracted by one scatter and the two parts are written in place, not
    concatenated."""
    d = x.shape[1]
    cd = n_classes * d
    err = torch.softmax(x @ w[:cd].view(n_classes, d).T + w[cd:], dim=1)
    err.scatter_add_(1, y.view(-1, 1), _minus_ones(len(y), err.dtype, err.device))  # p - Y: p_iy + (-1)
    err /= len(y)
    if out is None:
        out = torch.empty_like(w)
    torch.mm(err.T, x, out=out[:cd].view(n_classes, d))
    torch.sum(err, 0, out=out[cd:])
    return out


@lru_cache(maxsize=64)
def _minus_ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full((n, 1), -1.0, dtype=dtype, device=device)


@lru_cache(maxsize=8)
def _linear(input_shape: tuple[int, ...], n_classes: int) -> FlatModel:
    return linear_model(input_shape, n_classes)


def represent(c: ClientData, t: Represent) -> Represented:
    """The reference (and only) implementation: one client's Psi."""
    model = _linear(tuple(c.x.shape[1:]), c.n_classes) if t.anchor_model == "linear" else c.model
    if t.anchor.shape != (model.n_params,):
        raise UserError(
            f"represent task for client {t.client}: anchor has shape {tuple(t.anchor.shape)}, "
            f"the {t.anchor_model} anchor model has {model.n_params} parameters"
        )
    grad = linear_softmax_grad if t.anchor_model == "linear" else None
    if t.kind == "gradient":
        if grad is not None:
            g = grad(t.anchor, c.x.flatten(1), c.y, c.n_classes)
        else:
            w = t.anchor.detach().clone().requires_grad_(True)
            (g,) = torch.autograd.grad(model.mean_loss(model.forward(w, c.x), c.y), w)
    else:
        w = local_sgd(model, c.x, c.y, t.anchor, t.local, t.seed, grad=grad)
        g = t.anchor - w
    g = g.detach().double()
    if t.dim:
        g = count_sketch(g, t.dim, t.projection_seed)
    norm = g.norm()
    return Represented((g / norm if norm > 0 else g).float(), len(c.y))


def check_represented(task: Represent, result: Represented, train_size: int, test_size: int) -> Represented:
    """Asked length, finite; re-normalised to unit length by the server (a zero Psi passes and
    is rejected by StoCFL itself)."""
    if not isinstance(result.psi, torch.Tensor):
        raise BadResult("representation missing")
    psi = check_vector(result.psi, "representation", task.dim or task.anchor.numel())
    _count(result.n_samples, train_size, "n_samples")
    wide = psi.double()  # one float64 copy, divided in place
    norm = float(wide.norm())
    return Represented(wide.div_(norm).float() if norm > 0 else psi, result.n_samples)


register_task(
    Represent,
    Represented,
    represent,
    "query.represent",
    check_represented,
    reply_size=lambda t: max(t.anchor.numel(), t.dim),
)
