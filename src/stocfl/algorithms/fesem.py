"""FeSEM: multi-center federated learning (Long et al., 2022)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import ConfigDict, Field

from stocfl.algorithms.base import (
    Algorithm,
    AskClients,
    Context,
    Params,
    check_models_fit,
    lowest_train_loss,
    place_by_lowest_loss,
)
from stocfl.bounds import MAX_WEIGHT
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore


class FeSEMParams(Params):
    model_config = ConfigDict(populate_by_name=True)
    n_centers: int = Field(4, ge=1, le=1000, description="K: number of centers")
    lam: float = Field(
        0.1, ge=0, le=MAX_WEIGHT, alias="lambda", description="lambda: local loss + lambda ||W_i - W~_k||^2"
    )
    restarts: int = Field(20, ge=1, le=1000, description="K-means restarts for the initial centers")


class FeSEM(Algorithm):
    """K centers W~_k; clients keep local models W_i (stateful). Each round, for the sampled
    clients S_t (Long et al., section 4.3, in the order assign -> train -> update centres):

    1. E-step: i -> argmin_k ||W_i - W~_k||_2 on its stored local model W_i. A client sampled
       for the first time has no W_i: in round 1 every sampled client trains w_0 plainly for
       W_i and the centers are K-means of those models (``restarts`` random starts, least
       inertia kept); later, a first-time client joins the center with the lowest loss on its
       train data (its plain model from w_0 would sit nearest whichever center moved least).
    2. Local step: i trains from W~_k(i) on f_i(W) + lambda ||W - W~_k(i)||^2; the result is
       its new W_i.
    3. M-step (eq. 9): W~_k <- mean of the FRESH W_i of this round's clients assigned to k. The
       stored models of unsampled clients do not count: they date from earlier centers and
       would pull W~_k back; a center with no sampled client keeps its weights.

    All parameters are clustered (the authors' code uses one layer; this follows the paper).
    Clients use their center's model; clients never sampled the center with the lowest train
    loss. Round 1 needs at least K clients (m = ceil(rate * N) >= K).

    Parameters
    ----------
    n_centers : int, default 4
    lambda : float, default 0.1
    restarts : int, default 20
    """

    name = "fesem"
    placement = "the cluster model with the lowest loss on the client's train data"
    Params = FeSEMParams
    params: FeSEMParams

    @dataclass
    class State:
        local: ClientStore  # W_i of every client sampled so far
        centers: torch.Tensor | None  # the K centers (K x P); None before round 1
        labels: np.ndarray  # center of every client; -1: never sampled

    state: State

    def __init__(self, params: FeSEMParams, ctx: Context):
        super().__init__(params, ctx)
        if 0 < ctx.sample_size < params.n_centers:
            raise UserError(
                f"fesem: K = algorithm.n_centers = {params.n_centers} centers need at least K clients in "
                f"round 1, but a round samples {ctx.sample_size}; raise run.sample_rate or lower n_centers"
            )
        check_models_fit(params.n_centers, ctx, "n_centers")
        self.state = self.State(
            ctx.store("fesem_local", len(ctx.init_weights)),
            None,
            np.full(ctx.n_clients, -1, dtype=np.int64),
        )

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        if self.state.centers is None:
            first = torch.stack(
                [r.weights for r in ask([self.local_training(round_, i, self.ctx.init_weights, 1) for i in sampled])]
            )
            self.state.centers = self.kmeans(first)
            assign = self.nearest(first)
        else:
            known = [i for i in sampled if i in self.state.local]
            unknown = [i for i in sampled if i not in self.state.local]
            where = dict(
                zip(known, self.nearest(torch.stack([self.state.local.get(i) for i in known])) if known else [])
            )
            where.update(zip(unknown, lowest_train_loss(unknown, list(self.state.centers), ask)))
            assign = np.array([where[i] for i in sampled], dtype=np.int64)
        mu = 2 * self.params.lam  # tasks carry (mu/2)||.||^2
        results = ask(
            [
                self.local_training(round_, i, self.state.centers[k], prox_center=self.state.centers[k], prox_weight=mu)
                for i, k in zip(sampled, assign)
            ]
        )
        for k in range(len(self.state.centers)):
            mine = [r for r, a in zip(results, assign) if a == k]
            if mine:
                self.state.centers[k] = self.aggregate(mine, self.state.centers[k], [1.0] * len(mine))
        self.state.labels[sampled] = assign
        self.state.local.write({i: r.weights for i, r in zip(sampled, results)})
        return {"assigned": np.bincount(assign, minlength=len(self.state.centers)).tolist()}

    def nearest(self, models: torch.Tensor) -> np.ndarray:
        """E-step: the nearest center of each model (L2; ties: the lower index)."""
        assert self.state.centers is not None  # made in round 1, before any E-step
        return torch.cdist(models.double(), self.state.centers.double()).argmin(dim=1).numpy()

    def kmeans(self, local: torch.Tensor) -> torch.Tensor:
        from sklearn.cluster import KMeans

        k = self.params.n_centers
        if len(local) < k:
            raise UserError(
                f"fesem: K = algorithm.n_centers = {k} centers need at least K clients in round 1, "
                f"got {len(local)} (clients dropped?); raise run.sample_rate or lower n_centers"
            )
        km = KMeans(n_clusters=k, n_init=self.params.restarts, random_state=self.ctx.seed).fit(local.double().numpy())
        return torch.from_numpy(km.cluster_centers_).float()

    def global_model(self) -> torch.Tensor:
        return self.ctx.init_weights if self.state.centers is None else self.state.centers.mean(0)

    def client_models(self, clients, ask):
        if self.state.centers is None:
            return [self.ctx.init_weights] * len(clients)
        rows = list(self.state.centers)
        unseen = [i for i in clients if self.state.labels[i] < 0]
        guess = dict(zip(unseen, lowest_train_loss(unseen, rows, ask)))
        return [rows[int(self.state.labels[i])] if self.state.labels[i] >= 0 else rows[guess[i]] for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return self.state.labels.copy()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return {} if self.state.centers is None else dict(enumerate(self.state.centers))

    def place_new(self, clients, ask):
        if self.state.centers is None:
            return super().place_new(clients, ask)
        return place_by_lowest_loss(clients, dict(enumerate(self.state.centers)), ask)
