"""The descriptor query: a compact summary of a client's data in a model's latent space (FLUX,
Fenoglio et al., NeurIPS 2025; official code ``dariofenoglio98/FLUX``, ``public/models.py``,
``ModelEvaluator.extract_descriptors``).

The latent of a sample is what the model's feature extractor gives it: the input of the model's
first fully connected layer, flattened (the authors' LeNet-5 returns the flattened convolutional
features; for a multilayer perceptron it is the flattened input). Each latent is projected on k
fixed directions, the principal axes of 200 points drawn uniformly in [0, 1]^d with the task's
seed, after subtracting those points' mean: the authors' projection (scikit-learn's PCA fitted
on uniform random points), the same on every client. The descriptor is, in order,

* the projected latents' mean and standard deviation over the client's train data (2k numbers:
  P(X)); with ``labelled`` also
* for each label 0..C-1, the mean and standard deviation of the projected latents of the
  client's samples of that label (2Ck numbers: P(X|Y)), both -1 throughout for a label it holds
  at most one sample of (the authors' placeholder).

Without ``labelled`` (a new client without labels, at test time) only the first 2k numbers.

What it reveals: the first two moments of the client's data along k directions of the latent
space, overall and per label; which labels it holds at least two samples of. Not the samples,
and not how many it holds of each label.

A registered task kind (``query.describe``): every executor runs it and the Flower codec carries
it from its fields.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from stocfl.client.flops import CLIENT_CACHES
from stocfl.client.tasks import MAX_ABS, BadResult, ClientData, _count, check_vector, check_weights, register_task
from stocfl.errors import UserError

RANDOM_POINTS = 200  # the authors' PCA is fitted on 200 random points
MISSING = -1.0  # a label's block when the client holds at most one sample of it


@dataclass(frozen=True, eq=False)
class Describe:
    """The client's descriptor under the feature extractor of ``weights``: k = ``dim``
    projected directions (seeded by ``seed``), per label as well with ``labelled``;
    ``n_classes`` = C, which the server knows from the data."""

    client: int
    weights: torch.Tensor
    dim: int
    seed: int
    n_classes: int
    labelled: bool


@dataclass(frozen=True, eq=False)
class Described:
    descriptor: torch.Tensor  # (2k,) or (2k + 2Ck,) float32
    n_samples: int


def descriptor_size(dim: int, n_classes: int, labelled: bool) -> int:
    return 2 * dim * (1 + n_classes) if labelled else 2 * dim


def latent(model, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The input of the model's first ``nn.Linear`` layer at ``w``, flattened, (n, d): the
    feature extractor's output, computed without running the layers after it."""
    first = next((m for m in model.module.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        raise UserError("flux: the model has no fully connected (nn.Linear) layer whose input is its latent space")
    seen: list[torch.Tensor] = []

    class _Stop(Exception):
        pass

    def grab(_module, args):
        seen.append(args[0].reshape(len(args[0]), -1))
        raise _Stop

    handle = first.register_forward_pre_hook(grab)
    try:
        model.forward(w, x)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0]


@functools.lru_cache(maxsize=8)
def projection(d: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k principal axes (rows, (k, d) float64) and the mean (d,) of RANDOM_POINTS points
    drawn uniformly in [0, 1]^d with ``seed``; each axis signed so that its largest entry in
    magnitude is positive, so that every client, on any machine, projects alike."""
    g = torch.Generator().manual_seed(int(seed))
    pts = torch.rand((RANDOM_POINTS, d), generator=g, dtype=torch.float64)
    center = pts.mean(0)
    _, _, vh = torch.linalg.svd(pts - center, full_matrices=False)
    axes = vh[: min(k, len(vh))]
    sign = torch.sign(axes.gather(1, axes.abs().argmax(1, keepdim=True)))
    return axes * sign, center


CLIENT_CACHES.append(projection)  # every client computes the axes: a FLOP count includes them


def describe(c: ClientData, t: Describe) -> Described:
    """The reference: one forward pass to the latent over the client's train data, a chunk at a time."""
    model = c.model
    check_weights("describe", t, model.n_params)
    n = len(c.y)
    with torch.no_grad():
        x = model.layout(c.x)
        chunk = model.eval_chunk(x) if n else 1
        z = [latent(model, t.weights, x[a : a + chunk]).double() for a in range(0, n, chunk)]
    if not z:
        raise UserError(f"describe task for client {t.client}: the client holds no train data")
    lat = torch.cat(z)
    axes, center = projection(lat.shape[1], t.dim, t.seed)
    if len(axes) < t.dim:
        raise UserError(
            f"describe task for client {t.client}: {t.dim} directions asked of a latent space of {lat.shape[1]}"
        )
    proj = (lat - center) @ axes.T  # (n, k)

    def moments(rows: torch.Tensor) -> list[torch.Tensor]:
        return [rows.mean(0), rows.std(0, correction=0)]

    parts = moments(proj)
    if t.labelled:
        means, stds = [], []
        for label in range(t.n_classes):
            mine = proj[c.y == label]
            if len(mine) > 1:
                m, s = moments(mine)
            else:
                m = s = torch.full((t.dim,), MISSING, dtype=torch.float64)
            means.append(m)
            stds.append(s)
        parts += means + stds
    return Described(torch.cat(parts).float(), n)


def check_described(t: Describe, r: Described, train_size: int, test_size: int) -> Described:
    """A reply is the descriptor's length of finite numbers within MAX_ABS, standard
    deviations >= 0 (a per-label block either all MISSING or a deviation >= 0); anything else
    is refused."""
    _count(r.n_samples, train_size, "n_samples")
    k = t.dim
    d = check_vector(r.descriptor, "descriptor", descriptor_size(k, t.n_classes, t.labelled), MAX_ABS)
    if (d[k : 2 * k] < 0).any():
        raise BadResult("descriptor's standard deviations are negative")
    if t.labelled:
        blocks = d[2 * k :].reshape(2, t.n_classes, k)
        missing = (blocks == MISSING).all(2)
        if (missing[0] != missing[1]).any():
            raise BadResult("descriptor marks a label missing in its means but not its deviations")
        if (blocks[1][~missing[1]] < 0).any():
            raise BadResult("descriptor's per-label standard deviations are negative")
    return Described(d, r.n_samples)


register_task(
    Describe,
    Described,
    describe,
    "query.describe",
    check_described,
    reply_size=lambda t: descriptor_size(t.dim, t.n_classes, t.labelled),
)
