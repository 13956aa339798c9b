"""How the server combines the models its clients trained: the plain weighted mean (FedAvg's
rule) or a robust rule that bounds what one client can do to the result.

* ``mean``: sum_i |D_i| w_i / sum_i |D_i|.
* ``clip``: each update d_i = w_i - w_start is scaled down to norm at most C, then
  w_start + the weighted mean of the clipped updates (C = ``clip_norm``, or with 0 the median
  update norm of this aggregation, so that one client cannot set it).
* ``median``: the coordinate-wise median of the w_i (Yin et al., 2018), unweighted.
* ``trimmed_mean``: per coordinate, the floor(trim * n) largest and smallest values are
  dropped and the rest averaged (Yin et al., 2018), unweighted; with too few clients to trim
  anything it is the plain mean.

A client that sends weights far from everyone else's moves ``clip`` by at most C * its weight
share, and ``median`` or ``trimmed_mean`` not beyond the range of the honest values as long as
fewer than half (a trim fraction) of the clients are crafted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import numpy as np
import torch

from stocfl.client.tasks import FactoredTrained
from stocfl.config import RULES

Rule = Literal["mean", "clip", "median", "trimmed_mean"]
assert RULES == get_args(Rule)  # the config's names for them


MEAN_BLOCK = 1 << 18  # entries of the float64 sum held at once (2 MB: near a core's cache, few calls a vector)
FACTOR_ROWS = 1 << 13  # samples of factored replies in one product (their A and X rows: a few tens of MB)

Vector = torch.Tensor | FactoredTrained


def weighted_mean(vectors: Sequence[Vector], weights) -> torch.Tensor:
    """sum_i a_i v_i / sum_i a_i, accumulated in float64 for stability, returned as float32.

    Summed a block of entries at a time, every vector adding its part in turn: each entry's sum
    is the same sum in the same order as over whole vectors (a test checks it to the bit), but a
    model-sized float64 sum is never read and written once per vector. Factored replies
    (:class:`~stocfl.client.tasks.FactoredTrained`) are summed from their factors
    (:func:`factored_mean`)."""
    a = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    if a.sum() <= 0:
        raise ValueError("weighted_mean needs a positive total weight")
    if any(isinstance(v, FactoredTrained) for v in vectors):
        return factored_mean(vectors, [float(x) for x in a])
    alphas, total = [float(x) for x in a], a.sum()
    flat = [cast(torch.Tensor, v).reshape(-1) for v in vectors]
    n = flat[0].numel()
    out = torch.empty(n, dtype=torch.float32)
    acc = torch.empty(min(n, MEAN_BLOCK), dtype=torch.float64)
    wide = torch.empty_like(acc)  # a vector's block in float64, written in place (no allocation a block)
    for s in range(0, n, MEAN_BLOCK):
        part, x = acc[: min(MEAN_BLOCK, n - s)], wide[: min(MEAN_BLOCK, n - s)]
        part.zero_()
        for v, ai in zip(flat, alphas):
            part.add_(x.copy_(v[s : s + MEAN_BLOCK]), alpha=ai)
        out[s : s + len(part)] = (part / total).float()
    return out.reshape(cast(torch.Tensor, vectors[0]).shape)


def factored_mean(vectors: Sequence[Vector], weights: list[float]) -> torch.Tensor:
    """:func:`weighted_mean` of replies some or all of which are factored. A factored reply's
    first layer is alpha_i W_i + beta_i C_i + A_i^T X_i, so the weighted sum of the first layers
    is sum_i a_i alpha_i W_i + sum_i a_i beta_i C_i (a few distinct W and C: a round's starts
    and centers) plus [a_i A_i]^T [X_i], one product over all their samples (in blocks of
    FACTOR_ROWS) in place of forming every reply. The dense terms are summed in float64, the
    product in float32: the mean differs from that of the formed replies in the last bits."""
    total = sum(weights)
    ref = next(v for v in vectors if isinstance(v, FactoredTrained))
    h, d, p = ref.A.shape[1], ref.X.shape[1], ref.start.numel()
    hd = h * d
    dev = ref.A.device  # an accelerator's factors are summed there; the mean comes to the host
    acc = torch.zeros(p, dtype=torch.float64, device=dev)
    scale: dict[int, tuple[torch.Tensor, float]] = {}  # the coefficient of each distinct W and C

    def add(t: torch.Tensor, c: float) -> None:
        held = scale.get(id(t))
        scale[id(t)] = (t, c + (held[1] if held else 0.0))

    factored: list[tuple[FactoredTrained, float]] = []
    for v, ai in zip(vectors, weights):
        if not isinstance(v, FactoredTrained) or (v.A.shape[1], v.X.shape[1]) != (h, d):
            w = v.weights if isinstance(v, FactoredTrained) else v
            acc.add_(w.to(dev).double(), alpha=ai)
            continue
        factored.append((v.unchanged(), ai))
        add(v.start, ai * v.alpha)
        if v.center is not None and v.beta != 0.0:
            add(v.center, ai * v.beta)
        acc[hd:].add_(v.tail.to(dev).double(), alpha=ai)
    for t, c in scale.values():
        acc[:hd].add_(t[:hd].to(dev).double(), alpha=c)
    product = torch.zeros(h, d, dtype=ref.A.dtype, device=dev)
    block: list[tuple[FactoredTrained, float]] = []
    rows = 0
    for k, (v, ai) in enumerate(factored):
        block.append((v, ai))
        rows += len(v.A)
        if rows >= FACTOR_ROWS or k == len(factored) - 1:
            a_rows = torch.cat([u.A.to(dev) * bi for u, bi in block])
            x_rows = torch.cat([u.X.to(dev) for u, _ in block])
            product.addmm_(a_rows.T, x_rows)
            block, rows = [], 0
    acc[:hd].add_(product.reshape(-1).double())
    return (acc / total).float().cpu()


BLOCK = 1 << 22  # numbers per coordinate block of the coordinate-wise rules (memory stays O(BLOCK))


def _median(x: torch.Tensor) -> torch.Tensor:
    """The median along dim 0: the middle value, or the mean of the two middle values."""
    s, n = x.sort(dim=0).values, len(x)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def clipped_mean(
    vectors: list[torch.Tensor], weights, starts: list[torch.Tensor], clip_norm: float = 0.0
) -> torch.Tensor:
    """The weighted mean of start_i + d_i * min(1, C / ||d_i||), d_i = v_i - start_i."""
    norms = torch.stack([(v.double() - s.double()).norm() for v, s in zip(vectors, starts)])
    c = clip_norm if clip_norm > 0 else float(_median(norms))
    scale = [min(1.0, c / float(n)) if n > 0 else 1.0 for n in norms]
    a = np.asarray(weights, dtype=np.float64)
    if a.sum() <= 0:
        raise ValueError("clipped_mean needs a positive total weight")
    acc = torch.zeros_like(vectors[0], dtype=torch.float64)
    for v, s, ai, si in zip(vectors, starts, a, scale):
        acc.add_(s.double(), alpha=float(ai)).add_(v.double() - s.double(), alpha=float(ai) * si)
    return (acc / a.sum()).float()


def _by_blocks(vectors: list[torch.Tensor], f) -> torch.Tensor:
    """``f`` applied to (n, block) float64 slices of the stacked vectors, block by block."""
    out = torch.empty(vectors[0].numel(), dtype=torch.float32)
    step = max(1, BLOCK // len(vectors))
    for a in range(0, len(out), step):
        out[a : a + step] = f(torch.stack([v[a : a + step].double() for v in vectors])).float()
    return out


def coordinate_median(vectors: list[torch.Tensor]) -> torch.Tensor:
    return _by_blocks(vectors, _median)


def trimmed_mean(vectors: list[torch.Tensor], trim: float) -> torch.Tensor:
    n = len(vectors)
    k = int(np.floor(trim * n))
    return _by_blocks(vectors, lambda x: x.sort(dim=0).values[k : n - k].mean(0))


@dataclass(frozen=True)
class Aggregator:
    """The server's rule for combining trained models (``[aggregation]`` in the config)."""

    rule: Rule = "mean"
    clip_norm: float = 0.0
    trim: float = 0.1

    def __call__(
        self, vectors: Sequence[Vector], weights, start: torch.Tensor | Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Combine ``vectors`` (trained from ``start``: one model, or one per vector) with
        weights ``weights`` (|D_i|, or ones); ``median`` and ``trimmed_mean`` ignore the weights.
        A factored reply is averaged from its factors by the mean, formed for the other rules."""
        if not vectors:
            raise ValueError("nothing to aggregate")
        if self.rule == "mean":
            return weighted_mean(vectors, weights)
        dense = [v.weights if isinstance(v, FactoredTrained) else v for v in vectors]
        if self.rule == "clip":
            starts = [start] * len(dense) if isinstance(start, torch.Tensor) else list(start)
            return clipped_mean(dense, weights, starts, self.clip_norm)
        if self.rule == "median":
            return coordinate_median(dense)
        return trimmed_mean(dense, self.trim)
