"""FLUX: clustered FL from descriptors of the clients' data, without the number of clusters
(Fenoglio, Li, Barbiero, Lane, Langheinrich and Gjoreski, NeurIPS 2025)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import Field

from stocfl.algorithms.base import AskClients, Context, OneShotClusters, Params, Placement
from stocfl.bounds import MAX_COUNT
from stocfl.client.descriptor import Describe, Described
from stocfl.client.tasks import without_dropped

PROJECTION_SEED = 1  # the authors project every client's latents with the same seed (1)


class FLUXParams(Params):
    warmup_rounds: int = Field(
        4, ge=0, le=MAX_COUNT, description="FedAvg rounds before the clustering round (the authors' code: 4)"
    )
    dim: int = Field(
        0, ge=0, le=4096, description="k: latent directions a descriptor summarises; 0 = the number of classes C"
    )
    labelled: bool = Field(True, description="descriptors with each label's latent moments (P(X|Y)); false: P(X) only")
    eps_scaling: float = Field(
        1.0, gt=0, le=1e6, description="DBSCAN's eps = this x the knee of the sorted nearest-neighbour distances"
    )
    min_samples: int = Field(2, ge=1, le=MAX_COUNT, description="DBSCAN's min_samples (the authors: 2)")


def knee(y: np.ndarray) -> int | None:
    """The knee of an increasing convex curve ``y`` (at x = 0..n-1) by Kneedle (Satopaa et al.,
    2011) with sensitivity 1, offline, as the ``kneed`` package computes it for
    ``curve='convex', direction='increasing'``: both axes scaled to [0, 1], the curve flipped so
    that the knee is a maximum of the difference curve, and the first maximum whose difference
    drops below its threshold before a minimum is reached. None when there is none."""
    n = len(y)
    if n < 3 or float(y.max() - y.min()) <= 0:
        return None
    x = np.arange(n, dtype=np.float64)
    xn = (x - x.min()) / (x.max() - x.min())
    yn = (y - y.min()) / (y.max() - y.min())
    yt = np.flip(yn.max() - yn)  # convex increasing -> concave increasing
    diff = yt - xn
    left, right = np.concatenate([diff[:1], diff[:-1]]), np.concatenate([diff[1:], diff[-1:]])
    maxima = np.flatnonzero((diff >= left) & (diff >= right))
    minima = np.flatnonzero((diff <= left) & (diff <= right))
    if not len(maxima):
        return None
    step = float(np.abs(np.diff(xn)).mean())
    threshold, at, active = 0.0, 0, True
    for i in range(int(maxima[0]), n - 1):
        if i in maxima:
            threshold, at, active = float(diff[i] - step), i, True
        if i in minima:
            threshold, active = 0.0, False
        if active and diff[i + 1] < threshold:
            return n - 1 - at  # back to the unflipped curve
    return None


def cluster(descriptors: np.ndarray, eps_scaling: float, min_samples: int) -> tuple[np.ndarray, float, int]:
    """The authors' clustering (their method 4): eps = ``eps_scaling`` x the knee of the
    sorted distances of each descriptor to its nearest other; DBSCAN(eps, min_samples); every
    noise point a cluster of its own. Labels 0.. in order of each cluster's first client;
    returns (labels, eps, noise points)."""
    from sklearn.cluster import DBSCAN
    from sklearn.neighbors import NearestNeighbors

    n = len(descriptors)
    if n < 2:
        return np.zeros(n, dtype=np.int64), 0.0, 0
    dist, _ = NearestNeighbors(n_neighbors=2).fit(descriptors).kneighbors(descriptors)
    nearest = np.sort(dist[:, 1])
    k = knee(nearest)
    if k is None:  # no knee (a flat or too short curve): the point farthest below the chord
        span = nearest.max() - nearest.min()
        k = int(np.argmax(np.linspace(0, 1, n) - (nearest - nearest.min()) / span)) if span > 0 else n - 1
    eps = max(float(nearest[k]) * eps_scaling, 1e-12)  # DBSCAN needs eps > 0
    raw = DBSCAN(eps=eps, min_samples=min_samples).fit_predict(descriptors)
    noise = int((raw < 0).sum())
    first: dict[int, int] = {}
    out = np.empty(n, dtype=np.int64)
    for i, r in enumerate(raw):
        out[i] = first.setdefault(int(r) if r >= 0 else -1 - i, len(first))  # noise: its own cluster
    return out, eps, noise


def fit_scaler(descriptors: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The authors' min-max scaling: each block of ``block`` consecutive entries (a moment of k
    directions) is one feature, scaled by its minimum and range over every client and entry of
    the block (a range of 0 scales by 1, as scikit-learn's MinMaxScaler). Returns (mins, ranges)."""
    parts = descriptors.reshape(len(descriptors), -1, block)
    lo = parts.min((0, 2))
    span = parts.max((0, 2)) - lo
    return lo, np.where(span > 0, span, 1.0)


def scale(descriptors: np.ndarray, lo: np.ndarray, span: np.ndarray, block: int) -> np.ndarray:
    """``descriptors`` (n, b x block) scaled by the first b blocks of a fitted scaler."""
    parts = descriptors.reshape(len(descriptors), -1, block)
    b = parts.shape[1]
    return ((parts - lo[None, :b, None]) / span[None, :b, None]).reshape(len(descriptors), -1)


class FLUX(OneShotClusters):
    """FedAvg for ``warmup_rounds`` rounds. In the next round, the clustering round, every
    sampled client sends its descriptor under the global model w
    (:class:`~stocfl.client.descriptor.Describe`: the first two moments of its latents along
    k = ``dim`` directions, overall and, with ``labelled``, per label) and trains w; the server
    min-max scales the descriptors block by block, clusters them with DBSCAN at the knee of the
    nearest-neighbour distances (:func:`cluster`; no number of clusters is given, every noise
    point its own cluster), and starts each cluster's model as the mean of its members' models
    of that round. Afterwards each cluster runs FedAvg on its sampled members; w is kept as it
    was, the model every later descriptor is taken under. A client not clustered (not sampled
    then, held out, or whose data changed) sends its descriptor when first needed and joins the
    cluster whose centroid (the mean of its members' scaled descriptors) is nearest.

    A new client without labels (test time, :meth:`place_unlabeled`) sends the label-free part
    of its descriptor (2k numbers) and joins the cluster nearest in those coordinates.

    Settled (docs/algorithms/flux.md): the authors' simulation code clusters in round 5 (four
    FedAvg rounds); its server code starts instead once the round-to-round accuracy gain falls
    below 0.06, measured on validation splits that stocfl does not hold out, so the warm-up is a
    count. The random points of the projection lie in [0, 1]^d, where the authors take
    [0, 1.02 max latent] (a scale that rotates nothing: only the centre moves).

    Parameters
    ----------
    warmup_rounds : int, default 4
    dim : int, default 0 (the number of classes)
    labelled : bool, default True
    eps_scaling : float, default 1.0
    min_samples : int, default 2
    """

    name = "flux"
    placement = "the cluster whose centroid is nearest its scaled descriptor"
    places_unlabeled = True
    placement_unlabeled = "the cluster whose centroid is nearest the label-free part of its descriptor"
    Params = FLUXParams
    params: FLUXParams

    @dataclass
    class State:
        w: torch.Tensor  # FedAvg's model until the clustering round, then the descriptors' model
        labels: np.ndarray  # cluster of every client; -1: not placed
        models: dict[int, torch.Tensor]  # cluster id -> model; empty until the clustering round
        lo: np.ndarray  # the scaler's minimum of each block (empty until clustered)
        span: np.ndarray  # ... and its range
        centroids: dict[int, torch.Tensor]  # cluster id -> mean scaled descriptor (float64)

    state: State

    def __init__(self, params: FLUXParams, ctx: Context):
        super().__init__(params, ctx)
        self.k = params.dim or max(1, ctx.n_classes)
        self.state = self.State(
            ctx.init_weights.clone(),
            np.full(ctx.n_clients, -1, dtype=np.int64),
            {},
            np.zeros(0),
            np.zeros(0),
            {},
        )

    def describe_task(self, client: int, labelled: bool) -> Describe:
        return Describe(client, self.state.w, self.k, PROJECTION_SEED, self.ctx.n_classes, labelled)

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        if self.state.models:
            self.train_clusters(round_, sampled, ask)
            return {}
        w = self.state.w
        trainings = [self.local_training(round_, i, w) for i in sampled]
        if round_ <= self.params.warmup_rounds:
            self.state.w = self.aggregate(ask(trainings), w)
            return {}
        replies = ask([self.describe_task(i, self.params.labelled) for i in sampled] + trainings)
        described: list[Described] = replies[: len(sampled)]
        trained = replies[len(sampled) :]
        x = torch.stack([r.descriptor.double() for r in described]).numpy()
        self.state.lo, self.state.span = fit_scaler(x, self.k)
        scaled = scale(x, self.state.lo, self.state.span, self.k)
        labels, eps, noise = cluster(scaled, self.params.eps_scaling, self.params.min_samples)
        self.state.labels[sampled] = labels
        for c in np.unique(labels):
            mine = [r for r, lab in zip(trained, labels) if lab == c]
            self.state.models[int(c)] = self.aggregate(mine, w)
            self.state.centroids[int(c)] = torch.from_numpy(scaled[labels == c].mean(0))
        # the authors' code then places every other client at once, from its descriptor
        chosen = set(sampled)
        others = [i for i in self.ctx.present_at(round_) if i not in chosen]
        placed, found = without_dropped(others, lambda c: self.place_new(c, ask), "FLUX's descriptor query")
        for p in found:
            self.state.labels[p.client] = p.cluster
        return {
            "clustered": len(self.state.models),
            "clustered_clients": len(sampled),
            "placed_by_descriptor": len(placed),
            "flux_eps": eps,
            "flux_noise": noise,
        }

    def nearest(self, described: list[Described], width: int) -> list[int]:
        """Each reply's nearest centroid over the descriptors' first ``width`` entries (ties: the
        lower cluster id)."""
        ids = sorted(self.state.centroids)
        cents = torch.stack([self.state.centroids[c][:width] for c in ids]).numpy()
        x = scale(
            torch.stack([r.descriptor.double() for r in described]).numpy(), self.state.lo, self.state.span, self.k
        )
        dist = ((x[:, None, :] - cents[None]) ** 2).sum(2)
        return [ids[int(np.argmin(row))] for row in dist]

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        if not self.state.models:
            return super().place_new(clients, ask)
        if not clients:
            return []
        replies = ask([self.describe_task(i, self.params.labelled) for i in clients])
        width = replies[0].descriptor.numel()
        return [
            Placement(i, k, None, False, self.state.models[k]) for i, k in zip(clients, self.nearest(replies, width))
        ]

    def place_unlabeled(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """New clients without labels (the paper's test-time adaptation): each sends the
        label-free part of its descriptor (the moments of its latents, 2k numbers) and joins
        the cluster whose centroid is nearest in those coordinates."""
        if not self.state.models or not clients:
            return super().place_new(clients, ask)
        replies = ask([self.describe_task(i, False) for i in clients])
        return [
            Placement(i, k, None, False, self.state.models[k])
            for i, k in zip(clients, self.nearest(replies, 2 * self.k))
        ]
