"""CFL-GP: clustered FL by gradient-based partitioning (Kim, Kim and de Veciana, ICML 2024)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field

from stocfl.algorithms.base import (
    Algorithm,
    AskClients,
    Context,
    Params,
    Placement,
    check_models_fit,
    mean_model,
    place_by_lowest_loss,
)
from stocfl.bounds import MAX_COUNT
from stocfl.errors import UserError


class CFLGPParams(Params):
    n_models: int = Field(4, ge=1, le=64, description="K: cluster models (with warmup_rounds: the most considered)")
    period: int = Field(2, ge=1, le=MAX_COUNT, description="P: rounds between spectral partitions (the authors: 2)")
    stop_after: int = Field(
        10, ge=1, le=MAX_COUNT, description="no partition after this round (the authors' termination threshold: 10)"
    )
    warmup_rounds: int = Field(
        0,
        ge=0,
        le=MAX_COUNT,
        description="unknown K: rounds of one model before K is read off the profiles (0: K given)",
    )
    profile: Literal["last_layer", "full"] = Field(
        "last_layer", description="which entries of a client's updates its gradient profile keeps"
    )


def spectral_partition(g: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The authors' spectral step: the profile matrix G (one column per client) reduced to its
    top-k left singular directions, P_k^T G, and k-means (k-means++, 10 starts, seeded) on the
    reduced columns. Returns (labels, P_k, centres in the reduced space)."""
    from sklearn.cluster import KMeans

    u, _, _ = np.linalg.svd(g, full_matrices=False)
    pk = u[:, :k]
    reduced = (pk.T @ g).T
    km = KMeans(n_clusters=min(k, len(reduced)), n_init=10, random_state=seed).fit(reduced)
    return km.labels_.astype(np.int64), pk, km.cluster_centers_


def estimate_k(g: np.ndarray, most: int, seed: int) -> int:
    """The authors' ``get_num_cluster``: G reduced to its leading singular directions (as many
    as the position of the largest gap between consecutive singular values, at least 3), then
    the k in 2..``most`` whose k-means has the best silhouette."""
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    n = g.shape[1]
    if n < 3 or most < 2:
        return 1
    u, s, _ = np.linalg.svd(g, full_matrices=False)
    lead = int(np.clip(1 + np.argmax(s[:-1] - s[1:]) if len(s) > 1 else 1, 3, n))
    reduced = (u[:, :lead].T @ g).T
    scores = []
    for k in range(2, min(most, n - 1) + 1):
        labels = KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(reduced)
        scores.append(silhouette_score(reduced, labels) if len(set(labels)) > 1 else -1.0)
    return 2 + int(np.argmax(scores)) if scores else 1


def match(new: np.ndarray, old: np.ndarray, k: int) -> np.ndarray:
    """``new`` labels renamed by the permutation of 0..k-1 that agrees with ``old`` on the most
    clients (the authors try every permutation; an assignment problem gives the same optimum).
    Clients with ``old`` < 0 do not count."""
    from scipy.optimize import linear_sum_assignment

    known = old >= 0
    agree = np.zeros((k, k))
    np.add.at(agree, (new[known], old[known]), 1)
    rows, cols = linear_sum_assignment(-agree)
    rename = np.arange(k)
    rename[rows] = cols
    return rename[new]


class CFLGP(Algorithm):
    """K cluster models (initialised independently, seeds seed+1 .. seed+K) and each client's
    *gradient profile*: for every model k, the running mean of the update its data give model k
    (a local training from theta_k, w_i - theta_k, on the kept entries, ``profile``). Every
    P = ``period`` rounds up to ``stop_after``, each sampled client trains every model, its
    profile is updated, and the server partitions the profiled clients spectrally
    (:func:`spectral_partition`: the profile matrix reduced to its top-K left singular
    directions, k-means), renaming the clusters to agree most with the last partition
    (:func:`match`). Every round each cluster model is the FedAvg of its sampled members'
    trainings from it. A sampled client without a profile is profiled when first sampled and
    joins the nearest centre; a client never sampled is evaluated with the model of lowest
    train loss. With ``warmup_rounds`` W > 0 (K unknown): W rounds of one model (every client
    profiled on it), then K is read off the profiles (:func:`estimate_k`, at most
    ``n_models``), model 0 is copied to the others and the profiles start anew on K models.

    Settled (docs/algorithms/cflgp.md): the authors' code keeps one block of the profile (its
    criterion model never moves from 0) and computes it at the client's own cluster model; the
    paper accumulates gradients on each of the K models, which is what this does, with each
    client's own running mean (the authors' beta over rounds assumes every client every
    round). Updates (model averaging, one of the authors' two protocols) stand for gradients.

    Parameters
    ----------
    n_models : int, default 4
    period : int, default 2
    stop_after : int, default 10
    warmup_rounds : int, default 0
    profile : {"last_layer", "full"}, default "last_layer"
    """

    name = "cflgp"
    placement = "the cluster model of lowest train loss"
    Params = CFLGPParams
    params: CFLGPParams

    @dataclass
    class State:
        models: dict[int, torch.Tensor]  # cluster id -> theta_k
        labels: np.ndarray  # cluster of every client; -1: not placed
        profiles: torch.Tensor  # (N, K x d): each client's running mean update per model
        seen: np.ndarray  # how many profiles each client's running mean holds
        k: int  # K in use (the estimate, after a warm-up)
        basis: torch.Tensor  # (K x d, K): the last partition's singular directions
        centres: torch.Tensor  # (K, K): its k-means centres in the reduced space

    state: State

    def __init__(self, params: CFLGPParams, ctx: Context):
        super().__init__(params, ctx)
        if ctx.init_model is None:
            raise UserError("cflgp needs Context.init_model (seed -> weights) to initialise its models independently")
        check_models_fit(params.n_models, ctx, "n_models")
        p = len(ctx.init_weights)
        last = ctx.last_layer or p
        self.keep = slice(p - last, p) if params.profile == "last_layer" else slice(0, p)
        self.d = self.keep.stop - self.keep.start
        if ctx.n_clients * params.n_models * self.d * 4 > 8 << 30:
            raise UserError(
                f"config: algorithm.profile = {params.profile!r}: {ctx.n_clients} clients x {params.n_models} models x "
                f"{self.d} entries need more than 8 GiB; use profile = 'last_layer' or fewer n_models"
            )
        k = 1 if params.warmup_rounds else params.n_models
        self.state = self.State(
            {m: ctx.init_model(ctx.seed + 1 + m) for m in range(k)},
            np.zeros(ctx.n_clients, dtype=np.int64),  # every client starts with model 0
            torch.zeros((ctx.n_clients, k * self.d)),
            np.zeros(ctx.n_clients, dtype=np.int64),
            k,
            torch.zeros((k * self.d, 0), dtype=torch.float64),
            torch.zeros((0, 0), dtype=torch.float64),
        )

    def partition_round(self, round_: int) -> bool:
        p = self.params
        return round_ > p.warmup_rounds and (round_ - p.warmup_rounds - 1) % p.period == 0 and round_ <= p.stop_after

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        s, p = self.state, self.params
        out: dict[str, Any] = {}
        if p.warmup_rounds and round_ == p.warmup_rounds + 1 and s.k == 1:
            out["cflgp_k"] = self.settle_k()
        partition = self.partition_round(round_)
        profiled = [i for i in sampled if partition or s.seen[i] == 0]
        ids = sorted(s.models)
        tasks = [self.local_training(round_, i, s.models[k], purpose=k) for i in profiled for k in ids]
        fresh = set(profiled)
        own = [i for i in sampled if i not in fresh]
        tasks += [self.local_training(round_, i, s.models[int(s.labels[i])], purpose=int(s.labels[i])) for i in own]
        results = ask(tasks)
        trained: dict[tuple[int, int], Any] = {}
        for n, i in enumerate(profiled):
            rows = results[n * len(ids) : (n + 1) * len(ids)]
            for k, r in zip(ids, rows):
                trained[(i, k)] = r
            self.update_profile(i, [r.weights[self.keep] - s.models[k][self.keep] for k, r in zip(ids, rows)])
        for i, r in zip(own, results[len(profiled) * len(ids) :]):
            trained[(i, int(s.labels[i]))] = r
        if partition:
            out.update(self.partition())
        elif profiled and len(s.centres):
            s.labels[profiled] = self.nearest(profiled)
        elif profiled:
            s.labels[profiled] = 0
        for k in ids:
            mine = [trained[(i, k)] for i in sampled if s.labels[i] == k and (i, k) in trained]
            if mine:
                s.models[k] = self.aggregate(mine, s.models[k])
        return out

    def update_profile(self, i: int, updates: list[torch.Tensor]) -> None:
        """Client i's running mean of its updates on every model, one more profile in it."""
        s = self.state
        beta = 1.0 / (int(s.seen[i]) + 1)
        s.profiles[i] = (1 - beta) * s.profiles[i] + beta * torch.cat([u.float() for u in updates])
        s.seen[i] += 1

    def partition(self) -> dict[str, Any]:
        s = self.state
        who = np.flatnonzero(s.seen > 0)
        if not len(who):
            return {}
        g = s.profiles[who].double().numpy().T  # one column per client
        labels, basis, _ = spectral_partition(g, s.k, self.ctx.seed)
        old = s.labels[who]
        labels = match(labels, old, s.k)
        s.labels[who] = labels
        s.basis = torch.from_numpy(basis)
        reduced = basis.T @ g  # the centres under the matched names: each cluster's mean reduced profile
        s.centres = torch.from_numpy(
            np.stack(
                [
                    reduced[:, labels == k].mean(1) if (labels == k).any() else np.full(len(reduced), 1e30)
                    for k in range(s.k)
                ]
            )
        )
        return {"partitioned": len(who), "moved": int((old != labels).sum())}

    def nearest(self, clients: list[int]) -> np.ndarray:
        """The cluster whose centre (in the last partition's reduced space) is nearest each
        client's profile."""
        s = self.state
        z = (s.basis.T @ s.profiles[clients].double().T).T
        return torch.cdist(z, s.centres).argmin(1).numpy().astype(np.int64)

    def settle_k(self) -> int:
        """After the warm-up: K read off the profiles on model 0, model 0 copied to the others,
        the profiles started anew on K models."""
        s = self.state
        who = np.flatnonzero(s.seen > 0)
        k = estimate_k(s.profiles[who].double().numpy().T, self.params.n_models, self.ctx.seed) if len(who) else 1
        s.k = max(1, k)
        s.models = {m: s.models[0].clone() for m in range(s.k)}
        s.profiles = torch.zeros((self.ctx.n_clients, s.k * self.d))
        s.seen[:] = 0
        s.labels[:] = 0
        s.basis = torch.zeros((s.k * self.d, 0), dtype=torch.float64)
        s.centres = torch.zeros((0, 0), dtype=torch.float64)
        return s.k

    def drifted(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """A client whose data changed starts its profile anew: it is profiled when next sampled."""
        self.state.seen[clients] = 0
        self.state.profiles[clients] = 0.0
        return {"profiles_reset": len(clients)}

    # ---- what users see ----------------------------------------------------------------------
    def global_model(self) -> torch.Tensor:
        return mean_model([self.state.models[k] for k in sorted(self.state.models)])

    def client_models(self, clients: list[int], ask: AskClients) -> list[torch.Tensor]:
        s = self.state
        late = [i for i in clients if s.seen[i] == 0]
        placed = {p.client: p.cluster for p in self.place_new(late, ask)} if late else {}
        return [s.models[placed[i] if i in placed else int(s.labels[i])] for i in clients]

    def cluster_labels(self) -> np.ndarray:
        out = np.where(self.state.seen > 0, self.state.labels, -1)
        held = np.setdiff1d(np.arange(self.ctx.n_clients), self.ctx.training_clients)
        out[held] = -1
        return out

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(self.state.models)

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        return place_by_lowest_loss(clients, self.state.models, ask)
