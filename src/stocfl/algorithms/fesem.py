"""FeSEM: multi-center federated learning (Long et al., 2022)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import ConfigDict, Field

from stocfl.algorithms.base import Algorithm, Context, Params, RunTasks, lowest_train_loss, place_by_lowest_loss
from stocfl.store import ClientStore


class FeSEMParams(Params):
    model_config = ConfigDict(populate_by_name=True)
    n_centers: int = Field(4, ge=1, description="K: number of centers")
    lam: float = Field(0.1, ge=0, alias="lambda", description="lambda: local loss + lambda ||W_i - W~_k||^2")
    restarts: int = Field(20, ge=1, description="K-means restarts for the initial centers")


class FeSEM(Algorithm):
    """K centers W~_k; clients keep local models W_i (stateful). A client sampled for the first
    time first trains w_0 plainly to get W_i. Round 1: the centers are K-means of the first
    local models (``restarts`` random starts, least inertia kept). Every round, for the sampled
    clients: E-step, i -> argmin_k ||W_i - W~_k||_2; M-step, W~_k <- mean of its assigned W_i
    (a center with none keeps its weights); local step, i trains from W~_k(i) on
    f_i(W) + lambda ||W - W~_k(i)||^2 and stores the result as W_i. All parameters are
    clustered (the authors' code uses one layer; this follows the paper). Clients use their
    center's model; clients never sampled the center with the lowest train loss.

    Parameters
    ----------
    n_centers : int, default 4
    lambda : float, default 0.1
    restarts : int, default 20
    """

    name = "fesem"
    Params = FeSEMParams

    def __init__(self, params: FeSEMParams, ctx: Context):
        super().__init__(params, ctx)
        self.local = ClientStore(ctx.n_clients, len(ctx.init_weights), ctx.workdir, "fesem_local")
        self.centers: torch.Tensor | None = None
        self.labels = np.full(ctx.n_clients, -1, dtype=np.int64)

    def round(self, round_: int, sampled: list[int], run: RunTasks) -> dict[str, Any]:
        fresh = [i for i in sampled if i not in self.local]
        first = {i: r.weights for i, r in zip(fresh, run([self.local_training(round_, i, self.ctx.init_weights, 1)
                                                           for i in fresh]))}
        local = torch.stack([first[i] if i in first else self.local.get(i) for i in sampled])
        if self.centers is None:
            self.centers = self.kmeans(local)
        assign = torch.cdist(local.double(), self.centers.double()).argmin(dim=1).numpy()  # E-step
        for k in range(len(self.centers)):  # M-step
            if (assign == k).any():
                self.centers[k] = local[torch.from_numpy(assign == k)].double().mean(0).float()
        self.labels[sampled] = assign
        mu = 2 * self.params.lam  # tasks carry (mu/2)||.||^2
        results = run([self.local_training(round_, i, self.centers[k], prox_center=self.centers[k], prox_weight=mu)
                       for i, k in zip(sampled, assign)])
        self.local.write({i: r.weights for i, r in zip(sampled, results)})
        return {"assigned": np.bincount(assign, minlength=len(self.centers)).tolist()}

    def kmeans(self, local: torch.Tensor) -> torch.Tensor:
        from sklearn.cluster import KMeans

        k = self.params.n_centers
        if len(local) < k:
            raise ValueError(f"FeSEM needs at least K = {k} clients in the first round, got {len(local)}")
        km = KMeans(n_clusters=k, n_init=self.params.restarts, random_state=self.ctx.seed).fit(local.double().numpy())
        return torch.from_numpy(km.cluster_centers_).float()

    def global_model(self) -> torch.Tensor:
        return self.ctx.init_weights if self.centers is None else self.centers.mean(0)

    def client_models(self, clients, run):
        if self.centers is None:
            return [self.ctx.init_weights] * len(clients)
        rows = list(self.centers)
        unseen = [i for i in clients if self.labels[i] < 0]
        guess = dict(zip(unseen, lowest_train_loss(unseen, rows, run)))
        return [rows[int(self.labels[i])] if self.labels[i] >= 0 else rows[guess[i]] for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return self.labels.copy()

    def place_new(self, clients, run):
        if self.centers is None:
            return super().place_new(clients, run)
        return place_by_lowest_loss(clients, dict(enumerate(self.centers)), run)

    def state(self):
        rows, meta = self.local.state()
        tensors = {f"local/{k}": v for k, v in rows.items()}
        if self.centers is not None:
            tensors["centers"] = self.centers
        return tensors, {"labels": self.labels.tolist(), "local": meta}

    def load_state(self, tensors, meta):
        self.centers = tensors["centers"].clone() if "centers" in tensors else None
        self.labels = np.asarray(meta["labels"], dtype=np.int64)
        self.local.load_state({k[6:]: v for k, v in tensors.items() if k.startswith("local/")}, meta["local"])
