"""CFL: clustered federated learning by recursive bi-partitioning (Sattler et al., 2020)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from stocfl.algorithms.aggregation import weighted_mean
from stocfl.algorithms.base import Algorithm, AskClients, Context, Params, Placement, place_by_lowest_loss
from stocfl.bounds import MAX_COUNT, MAX_WEIGHT
from stocfl.client.gradient import Gradient


class CFLParams(Params):
    eps1: float = Field(0.4, ge=0, le=MAX_WEIGHT, description="split only if the norm of the MEAN update is below eps1")
    eps2: float = Field(1.6, ge=0, le=MAX_WEIGHT, description="... and the largest client update norm is above eps2")
    warmup: int = Field(20, ge=0, le=MAX_COUNT, description="rounds before any split")
    cluster_warmup: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="rounds the two halves of a split train before either may split again, as "
        "warmup does for the first split (the paper's Algorithm 2 runs FL to a stationary point at every level)",
    )
    similarity: Literal["updates", "gradients"] = Field(
        "updates",
        description="what the norms and cosines are of: the clients' weight updates dW_i (the authors' code), or "
        "their full-batch gradients at the cluster's updated model (the paper's Algorithm 2)",
    )


def bipartition(updates: torch.Tensor) -> np.ndarray:
    """Split clients in two minimising the largest cross-split cosine similarity: complete
    linkage on cosine DISTANCES (1 - cos), as scikit-learn's precomputed metric expects."""
    from sklearn.cluster import AgglomerativeClustering

    u = updates.double()
    u = u / u.norm(dim=1, keepdim=True).clamp(min=1e-12)
    dist = (1.0 - u @ u.T).clamp(min=0).numpy()
    np.fill_diagonal(dist, 0.0)
    return AgglomerativeClustering(n_clusters=2, metric="precomputed", linkage="complete").fit(dist).labels_


class CFL(Algorithm):
    """All clients start in one cluster: a client joins cluster 0 when first sampled while
    there is one cluster, and the cluster whose model has the lowest loss on its train data
    once there are several (partial participation; with all clients every round, as in the
    paper, every client is in cluster 0 from round 1). Each round the sampled members of every cluster c
    train c's model (FedAvg within c); with updates dW_i = w_i - w_c:
    mean_norm = ||weighted mean of dW_i||, max_norm = max_i ||dW_i||. After the warm-up, if
    mean_norm < eps1 and max_norm > eps2 and more than 2 members have fresh updates, c is split
    by ``bipartition`` of the fresh updates; both halves start from c's model. Members without
    a fresh update this round (partial participation) join the larger half. Splits recur, at
    any depth. mean_norm and max_norm of every cluster are logged every round.

    ``similarity = "gradients"`` is the paper's own Algorithm 2: after c's model is updated,
    its sampled members send their full-batch gradients nabla r_i(w_c) at it (a
    :class:`~stocfl.client.gradient.Gradient` query), and the norms (mean_norm of their
    n_i-weighted mean, nabla R_c; max_norm the largest) and the bipartition's cosines are of
    those gradients; eps1 and eps2 then bound gradient norms.

    Parameters
    ----------
    eps1 : float, default 0.4
    eps2 : float, default 1.6
    warmup : int, default 20
    cluster_warmup : int, default 0
        With warmup = cluster_warmup = 50, the earliest splits are at rounds 51, 102, 153: the
        paper's Fig. 3 (permuted CIFAR-10) splits at rounds 50, 100 and 150.
    similarity : {"updates", "gradients"}, default "updates"
    """

    name = "cfl"
    placement = "the cluster model with the lowest loss on the client's train data"
    Params = CFLParams
    params: CFLParams

    @dataclass
    class State:
        labels: np.ndarray  # cluster of every client; -1: not sampled yet
        models: dict[int, torch.Tensor]  # cluster id -> model
        next_id: int  # id of the next cluster a split opens
        opened: dict[int, int] = field(default_factory=dict)  # cluster -> round of the split that made it

    state: State

    def __init__(self, params: CFLParams, ctx: Context):
        super().__init__(params, ctx)
        self.state = self.State(np.full(ctx.n_clients, -1, dtype=np.int64), {0: ctx.init_weights.clone()}, 1)

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        for p in self.place_new([i for i in sampled if self.state.labels[i] < 0], ask):
            self.state.labels[p.client] = p.cluster
        results = ask([self.local_training(round_, i, self.state.models[int(self.state.labels[i])]) for i in sampled])
        norms, splits = [], 0
        for c in sorted(self.state.models):
            idx = [k for k, i in enumerate(sampled) if self.state.labels[i] == c]
            if not idx:
                continue
            w_c = self.state.models[c]
            dw = torch.stack([results[k].weights - w_c for k in idx])
            n = [results[k].n_samples for k in idx]
            mean_dw = weighted_mean(list(dw), n)
            # the updates are aggregated (from 0) and added: with the mean rule, FedAvg's w_c + mean dW
            robust = self.ctx.aggregator.rule != "mean"
            self.state.models[c] = w_c + (
                self.ctx.aggregator(list(dw), n, torch.zeros_like(w_c)) if robust else mean_dw
            )
            signal, mean_signal = dw, mean_dw
            if self.params.similarity == "gradients":  # at the model as it now stands
                grads = ask([Gradient(sampled[k], self.state.models[c]) for k in idx])
                signal = torch.stack([g.gradient for g in grads])
                mean_signal = weighted_mean(list(signal), n)
            mean_norm, max_norm = float(mean_signal.norm()), float(signal.norm(dim=1).max())
            norms.append({"cluster": c, "mean_norm": mean_norm, "max_norm": max_norm})
            rested = c not in self.state.opened or round_ - self.state.opened[c] > self.params.cluster_warmup
            if (
                round_ > self.params.warmup
                and rested
                and mean_norm < self.params.eps1
                and max_norm > self.params.eps2
                and len(idx) > 2
            ):
                new = self.split(c, [sampled[k] for k in idx], signal)
                self.state.opened[c] = self.state.opened[new] = round_
                splits += 1
        return {"cfl_norms": norms, "splits": splits}

    def split(self, c: int, fresh: list[int], signal: torch.Tensor) -> int:
        """Moves one half of c to a new cluster, whose id it returns (``signal``: the fresh
        members' updates or gradients, one row each)."""
        halves = bipartition(signal)
        ids = np.asarray(fresh)  # sub-matrix row k is client fresh[k]: map back to global ids
        side = {int(i): int(h) for i, h in zip(ids, halves)}
        larger = int(np.bincount(halves, minlength=2).argmax())
        new = self.state.next_id
        self.state.next_id += 1
        self.state.models[new] = self.state.models[c].clone()
        for i in np.flatnonzero(self.state.labels == c):
            if side.get(int(i), larger) == 1:
                self.state.labels[i] = new
        return new

    def global_model(self) -> torch.Tensor:
        return self.state.models[0] if len(self.state.models) == 1 else self._mean()

    def _mean(self) -> torch.Tensor:
        # CFL has no global model; the members-weighted mean of the cluster models stands in
        counts = {c: int((self.state.labels == c).sum()) for c in self.state.models}
        if not sum(counts.values()):
            return self.state.models[min(self.state.models)]
        return weighted_mean([self.state.models[c] for c in self.state.models], [counts[c] for c in self.state.models])

    def client_models(self, clients, ask):
        return self.labelled_models(clients, ask)

    def cluster_labels(self) -> np.ndarray:
        return self.state.labels.copy()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(self.state.models)

    def place_new(self, clients, ask):
        if len(self.state.models) == 1:
            (c,) = self.state.models
            return [Placement(i, c, None, False, self.state.models[c]) for i in clients]
        return place_by_lowest_loss(clients, self.state.models, ask)
