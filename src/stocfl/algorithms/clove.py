"""CLoVE: clustered FL by clustering loss-vector embeddings (Bhatia et al., ICML 2026,
arXiv 2506.22427)."""

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
    train_losses,
)
from stocfl.errors import UserError

# K is chosen by silhouette only if it beats the best smaller K by this factor (the authors'
# 10% tolerance, which prefers the smaller, more parsimonious K)
SILHOUETTE_TOLERANCE = 1.10


class CLoVEParams(Params):
    n_models: int = Field(
        0, ge=0, le=1000, description="K: number of cluster models; 0 = unknown, chosen every round by silhouette"
    )
    max_models: int = Field(15, ge=2, le=1000, description="the upper bound on K when K is unknown (models kept)")
    init: Literal["same", "different"] = Field(
        "different", description="each model starts from its own seed (seed+1 ..), or every one from w_0"
    )
    first_round: Literal["loss", "random"] = Field(
        "random", description="the first round assigns its clients at random, or clusters their loss vectors"
    )
    clustering: Literal["kmeans", "agglomerative"] = Field(
        "kmeans", description="how the loss vectors are clustered (the authors' default: k-means)"
    )
    loss_transform: Literal["identity", "sqrt"] = Field(
        "identity", description="the loss vectors as they are, or their square roots (the authors' ablation)"
    )
    matching: Literal["loss", "order"] = Field(
        "loss",
        description="clusters to models by a min-cost matching of the clusters' total losses (the paper's), "
        "or in the order of their lowest client (its ablation)",
    )
    stable_rounds: int = Field(
        0,
        ge=0,
        le=1000,
        description="stop clustering once every sampled client kept its model this many rounds; 0 = never",
    )


def choose_k(x: np.ndarray, most: int, seed: int) -> int:
    """The number of clusters of the rows of ``x`` by the silhouette of Ward's agglomerative
    clustering over K = 2 .. min(n, ``most``), a larger K taken only if its score beats the best so
    far by 10% (the authors' rule). Where K may reach n, every row is repeated 5 times, as the
    authors do, so that a silhouette exists. Fewer than 2 distinct rows: 1."""
    from sklearn.cluster import AgglomerativeClustering
    from sklearn.metrics import silhouette_score

    distinct = len(np.unique(x, axis=0))
    top = min(len(x), most)
    if distinct < 2 or top < 2:
        return 1
    pts = np.repeat(x, 5, axis=0) if top >= len(x) else x
    best_k, best = 1, -1.0
    for k in range(2, top + 1):
        labels = AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(pts)
        if len(set(labels)) < 2 or len(set(labels)) >= len(pts):
            continue
        score = float(silhouette_score(pts, labels, random_state=seed))
        if score > best * SILHOUETTE_TOLERANCE:
            best_k, best = k, score
    return min(best_k, distinct)


def cluster_rows(x: np.ndarray, k: int, how: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels 0..k'-1, centroids k' x dim) of the rows of ``x`` in k' <= ``k`` clusters (no more
    than the distinct rows), k-means seeded with ``seed`` or Ward's agglomerative clustering;
    labels renumbered in order of each cluster's first row."""
    from sklearn.cluster import AgglomerativeClustering, KMeans

    k = max(1, min(k, len(np.unique(x, axis=0))))
    if k == 1:
        raw = np.zeros(len(x), dtype=np.int64)
    elif how == "kmeans":
        raw = KMeans(n_clusters=k, random_state=seed, n_init="auto").fit(x).labels_
    else:
        raw = AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(x)
    first: dict[int, int] = {}
    labels = np.array([first.setdefault(int(c), len(first)) for c in raw], dtype=np.int64)
    centroids = np.stack([x[labels == c].mean(0) for c in range(len(first))])
    return labels, centroids


def match_clusters(labels: np.ndarray, clients: list[int], x: np.ndarray, how: str) -> np.ndarray:
    """The model of each cluster (labels 0..k-1 of the rows of ``x``, row i being client
    ``clients[i]``), every cluster a different model: by a min-cost matching where a cluster's
    cost on model m is its clients' total (transformed) loss on m (the paper's), or model c for
    the c-th cluster in order of its lowest client ('order', the authors' ablation)."""
    from scipy.optimize import linear_sum_assignment

    k = int(labels.max()) + 1
    ids = np.asarray(clients)
    order = sorted(range(k), key=lambda c: int(ids[labels == c].min()))
    out = np.zeros(k, dtype=np.int64)
    if how == "order":
        out[order] = np.arange(k)
        return out
    cost = np.stack([x[labels == c].sum(0) for c in order])  # clusters in order x models
    rows, cols = linear_sum_assignment(cost)
    out[np.asarray(order)[rows]] = cols
    return out


def random_assignment(n: int, k: int, round_: int, seed: int) -> np.ndarray:
    """n clients to k models uniformly at random, every model given at least one client where
    n >= k (the authors' random first round)."""
    rng = np.random.default_rng([seed, round_, 0xC10E])
    out = rng.integers(0, k, n)
    if n >= k:
        missing = np.setdiff1d(np.arange(k), out)
        free = np.flatnonzero(np.bincount(out, minlength=k)[out] > 1)  # clients whose model has others
        for m in missing:
            j = rng.choice(free)
            out[j] = m
            free = np.flatnonzero(np.bincount(out, minlength=k)[out] > 1)
    return out


class CLoVE(Algorithm):
    """K cluster models (K = ``max_models`` when K is unknown), each from its own seed
    (``init``). The first round assigns its clients to models at random (``first_round``). From
    then on, each round every sampled client evaluates all K models on its TRAIN data, giving its
    loss vector; the server clusters the loss vectors (k-means; when K is unknown, its K by
    silhouette, :func:`choose_k`) and matches clusters to models (:func:`match_clusters`). Each
    client trains its model and each model becomes the weighted mean of its clients' returns (a
    model nobody trains keeps its weights). With ``stable_rounds`` > 0, once every sampled client
    kept its model that many times in a row, clustering stops: a client keeps its last model and
    one seen for the first time joins the model of the centroid nearest to its loss vector.

    Settled (docs/algorithms/clove.md): the defaults are the authors' supervised experiments
    (independent initialisations, a random first round, no early stop; their unknown-K runs are
    ``init="same"``, ``first_round="loss"``, ``stable_rounds=3``); the stability test reads all of
    a client's last ``stable_rounds`` models (the authors' loop compares only the oldest with the
    newest); a newcomer's loss vector is on its train data (the authors' on its test data); a
    client not yet sampled is predicted with the model of the centroid nearest to its loss vector
    (the lowest train loss before any clustering).

    Parameters
    ----------
    n_models : int, default 0 (K unknown)
    max_models : int, default 15
    init : {"different", "same"}, default "different"
    first_round : {"random", "loss"}, default "random"
    clustering : {"kmeans", "agglomerative"}, default "kmeans"
    loss_transform : {"identity", "sqrt"}, default "identity"
    matching : {"loss", "order"}, default "loss"
    stable_rounds : int, default 0 (never stop)
    """

    name = "clove"
    placement = "the model of the centroid nearest to its loss vector (the lowest train loss before any clustering)"
    Params = CLoVEParams
    params: CLoVEParams

    @dataclass
    class State:
        models: list[torch.Tensor]  # the K (or max_models) cluster models
        labels: np.ndarray  # every client's latest model (-1: never placed)
        history: np.ndarray  # (N, stable_rounds): its last models, oldest first, -1 where fewer
        frozen: bool  # clustering stopped
        centroids: np.ndarray  # (k, K) the last clustering's centroids (0 rows: none yet)
        centroid_model: np.ndarray  # (k,) the model each centroid was matched to

    state: State

    def __init__(self, params: CLoVEParams, ctx: Context):
        super().__init__(params, ctx)
        k = params.n_models or params.max_models
        check_models_fit(k, ctx, "n_models" if params.n_models else "max_models")
        if params.init == "same":
            models = [ctx.init_weights.clone() for _ in range(k)]
        elif ctx.init_model is None:
            raise UserError("clove needs Context.init_model (seed -> weights) to initialise its models independently")
        else:
            models = [ctx.init_model(ctx.seed + 1 + m) for m in range(k)]
        self.state = self.State(
            models,
            np.full(ctx.n_clients, -1, dtype=np.int64),
            np.full((ctx.n_clients, params.stable_rounds), -1, dtype=np.int64),
            False,
            np.zeros((0, k)),
            np.zeros(0, dtype=np.int64),
        )

    def loss_vectors(self, clients: list[int], ask: AskClients) -> np.ndarray:
        """Each client's loss under every model on its train data (transformed), clients x K."""
        x = train_losses(clients, self.state.models, ask)
        return np.sqrt(x) if self.params.loss_transform == "sqrt" else x

    def stable(self, clients: list[int]) -> bool:
        h = self.state.history[clients]
        return bool(self.params.stable_rounds and len(clients) and (h >= 0).all() and (h == h[:, -1:]).all())

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        p = self.params
        if not self.state.frozen and self.stable(sampled):
            self.state.frozen = True
        out: dict[str, Any] = {"frozen": self.state.frozen}
        if self.state.frozen:
            placed = self.place_new([i for i in sampled if self.state.labels[i] < 0], ask)
            if placed:
                self.assign([pl.client for pl in placed], np.array([pl.cluster for pl in placed]))
        elif p.first_round == "random" and not (self.state.labels >= 0).any():  # the first round
            self.assign(sampled, random_assignment(len(sampled), len(self.state.models), round_, self.ctx.seed))
        else:
            x = self.loss_vectors(sampled, ask)
            k = p.n_models or choose_k(x, p.max_models, self.ctx.seed)
            labels, centroids = cluster_rows(x, k, p.clustering, self.ctx.seed)
            to = match_clusters(labels, sampled, x, p.matching)
            self.state.centroids, self.state.centroid_model = centroids, to
            self.assign(sampled, to[labels])
            out["clusters"] = len(to)
        chosen = self.state.labels[sampled]
        results = ask([self.local_training(round_, i, self.state.models[int(m)]) for i, m in zip(sampled, chosen)])
        for m in np.unique(chosen).tolist():
            mine = [r for r, c in zip(results, chosen) if c == m]
            self.state.models[m] = self.aggregate(mine, self.state.models[m])
        out["choices"] = np.bincount(chosen, minlength=len(self.state.models)).tolist()
        return out

    def assign(self, clients: list[int], models: np.ndarray) -> None:
        self.state.labels[clients] = models
        if self.params.stable_rounds:
            h = self.state.history
            h[clients] = np.concatenate([h[clients][:, 1:], np.asarray(models)[:, None]], axis=1)

    def used(self) -> list[int]:
        return sorted(set(self.state.labels[self.state.labels >= 0].tolist()))

    def global_model(self) -> torch.Tensor:
        # CLoVE has no global model; the plain mean of the models in use stands in for global_accuracy
        return mean_model([self.state.models[m] for m in self.used()] or self.state.models)

    def client_models(self, clients, ask):
        return self.labelled_models(clients, ask)

    def cluster_labels(self) -> np.ndarray:
        return self.state.labels.copy()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return {m: self.state.models[m] for m in self.used()}

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        if not clients:
            return []
        x = self.loss_vectors(clients, ask)
        if len(self.state.centroids):
            d = ((x[:, None, :] - self.state.centroids[None]) ** 2).sum(2)
            best = self.state.centroid_model[d.argmin(1)]
        else:
            best = x.argmin(1)
        return [Placement(i, int(m), None, False, self.state.models[int(m)]) for i, m in zip(clients, best)]
