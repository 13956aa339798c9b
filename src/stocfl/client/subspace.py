"""The subspace query: a few principal directions of a client's own train data, per label
(PACFL, Vahidian et al., AAAI 2023).

For each label the client holds, the samples of that label as the columns of a d x n_l matrix
(d = the input's size, raw inputs, not centred, as the authors' code takes them), its thin
SVD, and the first p left singular vectors (fewer where the label has fewer samples). The
reply is their rows, label by label in increasing label order, flattened: at most p x C
unit vectors of length d. What it reveals: for each label the client holds, the directions
its images of that label span most (the first is close to the direction of that label's mean
image), and which labels it holds with at least one sample; not the samples themselves and
not their count per label beyond min(n_l, p).

A registered task kind (``query.subspace``): every executor runs it and the Flower codec
carries it from its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stocfl.client.tasks import BadResult, ClientData, _count, check_vector, register_task
from stocfl.errors import UserError

UNIT_TOLERANCE = 1e-3  # how far a returned basis vector's length may be from 1


@dataclass(frozen=True, eq=False)
class Subspace:
    """The first ``n_basis`` left singular vectors of each label's d x n_l data matrix;
    ``dim`` = d, the size of one input, and ``n_classes`` = C, which the server knows from
    the data."""

    client: int
    n_basis: int
    dim: int
    n_classes: int


@dataclass(frozen=True, eq=False)
class Subspaced:
    basis: torch.Tensor  # (n_columns * dim,): n_columns unit vectors, one after another
    n_columns: int
    n_samples: int


def label_bases(x: torch.Tensor, y: torch.Tensor, n_basis: int) -> torch.Tensor:
    """The rows of each label's first ``n_basis`` left singular vectors, (k, d) float64."""
    flat = x.reshape(len(x), -1).double()
    rows = []
    for label in torch.unique(y).tolist():  # sorted
        data = flat[y == label].T  # d x n_l, the label's samples as columns
        u, _, _ = torch.linalg.svd(data, full_matrices=False)
        rows.append(u[:, : min(n_basis, data.shape[1])].T)
    if not rows:
        return torch.zeros((0, flat.shape[1]), dtype=torch.float64)
    return torch.cat(rows)


def subspace_one(c: ClientData, t: Subspace) -> Subspaced:
    d = int(np.prod(c.x.shape[1:])) if c.x.dim() > 1 else 1
    if t.dim != d:
        raise UserError(f"subspace task for client {t.client}: dim = {t.dim}, but one input has {d} entries")
    basis = label_bases(c.x, c.y, t.n_basis)
    return Subspaced(basis.reshape(-1).float(), len(basis), len(c.y))


def check_subspaced(t: Subspace, r: Subspaced, train_size: int, test_size: int) -> Subspaced:
    """A reply holds at most ``n_basis`` vectors per label of the run (and no more than the
    client's samples), each of length ``dim`` and of unit length: anything else is refused."""
    _count(r.n_samples, train_size, "n_samples")
    k = r.n_columns
    most = min(t.n_basis * t.n_classes, train_size)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= most:
        raise BadResult(f"n_columns = {k!r}, expected an integer in 0..{most}")
    if train_size and not k:
        raise BadResult("n_columns = 0, but the client holds train data")
    b = check_vector(r.basis, "basis", int(k) * t.dim, 1.0 + UNIT_TOLERANCE)
    if k:
        norms = b.reshape(int(k), t.dim).double().norm(dim=1)
        worst = float((norms - 1).abs().max())
        if worst > UNIT_TOLERANCE:
            raise BadResult(f"basis vectors have lengths off 1 by up to {worst:.3g}, expected unit vectors")
    return Subspaced(b, int(k), r.n_samples)


register_task(
    Subspace,
    Subspaced,
    subspace_one,
    "query.subspace",
    check_subspaced,
    reply_size=lambda t: t.n_classes * t.n_basis * t.dim,
    cost_by_labels=True,
)
