"""SR-FCA: successive refinement of a threshold clustering of local models (Vardhan, Ghosh and
Mazumdar, TMLR 2024)."""

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
    OneShotClusters,
    Params,
    Placement,
    mean_model,
    place_by_lowest_loss,
    train_losses,
)
from stocfl.bounds import MAX_COUNT, MAX_EPOCHS
from stocfl.client.tasks import without_dropped
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore


class SRFCAParams(Params):
    init_epochs: int = Field(
        20, ge=1, le=MAX_EPOCHS, description="local epochs of every client's own model in the first round (INIT)"
    )
    metric: Literal["cross_entropy", "euclidean"] = Field(
        "cross_entropy",
        description="distance of two models: the mean of their losses on each other's data (the authors' "
        "MNIST choice), or of their weights",
    )
    threshold: float = Field(
        0.0, ge=0, le=1e12, description="lambda: models this close are linked; 0 = the dist_fraction quantile"
    )
    dist_fraction: float = Field(
        0.1,
        gt=0,
        lt=1,
        description="with threshold 0: lambda is this quantile of the INIT pairwise distances (below the share "
        "of pairs within one group: 1/K for K equal groups)",
    )
    size_threshold: int = Field(2, ge=0, le=MAX_COUNT, description="t: clusters of at most t clients are dropped")
    refine_rounds: int = Field(10, ge=1, le=MAX_COUNT, description="FedAvg rounds within clusters per REFINE step")
    refine_steps: int = Field(2, ge=0, le=MAX_COUNT, description="REFINE steps (the authors: 2)")


def pivot_clusters(linked: np.ndarray, order: np.ndarray, size_threshold: int) -> list[list[int]]:
    """Correlation clustering by pivots (the authors' ``correlation_clustering``): take the next
    unclustered node of ``order`` as a pivot, cluster it with its unclustered neighbours in the
    graph ``linked`` (a symmetric boolean matrix), repeat; clusters of at most
    ``size_threshold`` nodes are dropped."""
    left = np.ones(len(linked), dtype=bool)
    out = []
    for p in order:
        if not left[p]:
            continue
        members = [int(p)] + [int(j) for j in np.flatnonzero(linked[p] & left) if j != p]
        left[members] = False
        out.append(sorted(members))
    return [c for c in out if len(c) > size_threshold]


class SRFCA(OneShotClusters):
    """INIT, in round 1: every participant present trains its own model from w_0 for
    ``init_epochs`` epochs; the server links two clients whose models are within lambda
    (``metric``; ``threshold``, or the ``dist_fraction`` quantile of the pairwise distances) and
    clusters the graph by pivots (:func:`pivot_clusters`), dropping clusters of at most t =
    ``size_threshold`` clients. Then ``refine_steps`` REFINE steps: ``refine_rounds`` rounds of
    FedAvg within each cluster over its sampled members; RECLUSTER, every client with an own
    model to the cluster model nearest it (clusters left with at most t clients dropped); MERGE,
    clusters whose models are within lambda joined by the same pivot clustering (a merged
    model is its parts' mean weighted by their members). Afterwards FedAvg within the clusters.
    A client in no cluster (not present at INIT, or in a cluster that was dropped) joins the
    cluster whose model has its lowest train loss when it is sampled, and is evaluated so.

    Settled (docs/algorithms/srfca.md): the cross-entropy distance of two models is the mean of
    each one's train loss on the other's clients (the authors' ``compute_dist``); the pivots are
    taken in an order drawn from the run's seed (the authors' are random, unseeded); a refine
    step's cluster models start from the last step's (the authors' code starts each step's
    models anew); aggregation is the run's ``[aggregation]`` rule (the authors use a trimmed
    mean, ``[aggregation] rule = "trimmed_mean"`` here).

    Parameters
    ----------
    init_epochs : int, default 20
    metric : {"cross_entropy", "euclidean"}, default "cross_entropy"
    threshold : float, default 0.0 (the dist_fraction quantile)
    dist_fraction : float, default 0.1
    size_threshold : int, default 2
        Where INIT leaves no cluster larger than t, none is dropped.
    refine_rounds : int, default 10
    refine_steps : int, default 2
    """

    name = "srfca"
    placement = "the cluster model of lowest train loss"
    Params = SRFCAParams
    params: SRFCAParams

    @dataclass
    class State:
        w: torch.Tensor  # w_0: where every model starts (and the stand-in global model before INIT)
        labels: np.ndarray  # cluster of every client; -1: in none
        models: dict[int, torch.Tensor]  # cluster id -> theta_k (empty until INIT)
        local: ClientStore  # every client's own model from INIT
        cross: ClientStore  # row i: the loss of every client's own model on client i's data (cross_entropy)
        threshold: float  # lambda in use
        steps: int  # REFINE steps done
        since: int  # rounds of FedAvg since INIT or the last step
        next_id: int

    state: State

    def __init__(self, params: SRFCAParams, ctx: Context):
        super().__init__(params, ctx)
        n, p = ctx.n_clients, len(ctx.init_weights)
        if n * (p + n) * 4 > 64 << 30:
            raise UserError(
                f"srfca keeps every client's own model and cross losses: {n} x {p + n} floats need more than 64 GiB"
            )
        self.state = self.State(
            ctx.init_weights.clone(),
            np.full(n, -1, dtype=np.int64),
            {},
            ctx.store("srfca_local", p, n),
            ctx.store("srfca_cross", n if params.metric == "cross_entropy" else 1, n),
            0.0,
            0,
            0,
            0,
        )

    # ---- the distances ------------------------------------------------------------------------
    def owned(self) -> list[int]:
        return [i for i in self.ctx.training_clients if i in self.state.local]

    def client_distances(self, who: list[int]) -> np.ndarray:
        """Pairwise distances of the clients' own models."""
        if self.params.metric == "euclidean":
            w = torch.stack([self.state.local.get(i) for i in who]).double()
            return torch.cdist(w, w).numpy()
        c = self.cross_losses(who, who)
        return (c + c.T) / 2

    def to_clusters(self, who: list[int], ask: AskClients) -> tuple[list[int], np.ndarray]:
        """Distance of each client's own model to each cluster model, (clients, clusters)."""
        ids = sorted(self.state.models)
        if self.params.metric == "euclidean":
            w = torch.stack([self.state.local.get(i) for i in who]).double()
            m = torch.stack([self.state.models[k] for k in ids]).double()
            return ids, torch.cdist(w, m).numpy()
        theta_on_i = train_losses(who, [self.state.models[k] for k in ids], ask)  # (who, K)
        out = np.zeros((len(who), len(ids)))
        for c, k in enumerate(ids):
            mine = set(who)
            members = np.array([j for j in np.flatnonzero(self.state.labels == k) if j in mine], dtype=np.int64)
            cols = np.asarray(who, dtype=np.int64)
            own_on_members = self.cross_losses(members, cols).mean(0) if len(members) else theta_on_i[:, c]
            out[:, c] = (theta_on_i[:, c] + own_on_members) / 2
        return ids, out

    def cluster_distances(self, ids: list[int], ask: AskClients) -> np.ndarray:
        """Pairwise distances of the cluster models."""
        if self.params.metric == "euclidean":
            m = torch.stack([self.state.models[k] for k in ids]).double()
            return torch.cdist(m, m).numpy()
        who = [i for i in self.owned() if self.state.labels[i] >= 0]
        loss = train_losses(who, [self.state.models[k] for k in ids], ask)  # (who, K)
        lab = self.state.labels[who]
        on = np.stack([loss[lab == k].mean(0) for k in ids])  # on[a, b]: model b on cluster a's clients
        return (on + on.T) / 2

    def cross_losses(self, rows, cols) -> np.ndarray:
        """cross[i, j] for i in ``rows``, j in ``cols``: client j's own model's loss on client i's data."""
        cols = np.asarray(cols, dtype=np.int64)
        return np.stack([self.state.cross.get(int(i)).double().numpy()[cols] for i in rows]).reshape(
            len(rows), len(cols)
        )

    def order(self, n: int, salt: int) -> np.ndarray:
        return np.random.default_rng([self.ctx.seed, 11, salt]).permutation(n)

    # ---- the steps ----------------------------------------------------------------------------
    def init(self, round_: int, ask: AskClients) -> dict[str, Any]:
        p, s = self.params, self.state
        asked = self.ctx.present_at(round_)
        who, trained = without_dropped(
            asked,
            lambda c: ask([self.local_training(round_, i, s.w, epochs=p.init_epochs) for i in c]),
            f"round {round_}: SR-FCA's INIT",
        )
        if not who:
            return {"clustered": 0}
        s.local.write({i: r.weights for i, r in zip(who, trained)})
        if p.metric == "cross_entropy":
            losses = train_losses(who, [r.weights for r in trained], ask)  # (i, j): model of who[j] on who[i]
            rows = np.zeros((len(who), self.ctx.n_clients), dtype=np.float32)
            rows[:, who] = losses
            s.cross.write({i: torch.from_numpy(row) for i, row in zip(who, rows)})
        d = self.client_distances(who)
        upper = d[np.triu_indices(len(who), 1)]
        s.threshold = p.threshold or (float(np.quantile(upper, p.dist_fraction)) if len(upper) else 0.0)
        clusters = pivot_clusters(d <= s.threshold, self.order(len(who), 0), p.size_threshold)
        if not clusters:  # every cluster at most t clients: none dropped (the authors' code stops here)
            clusters = pivot_clusters(d <= s.threshold, self.order(len(who), 0), 0)
        for members in clusters:
            k, s.next_id = s.next_id, s.next_id + 1
            ids = [who[m] for m in members]
            s.labels[ids] = k
            s.models[k] = s.w.clone()
        return {"clustered": len(clusters), "clustered_clients": sum(map(len, clusters)), "srfca_lambda": s.threshold}

    def refine(self, ask: AskClients) -> dict[str, Any]:
        """RECLUSTER every client with an own model, drop small clusters, MERGE close ones."""
        self.recluster(ask)
        merges = self.merge(ask)
        self.state.steps += 1
        self.state.since = 0
        return {
            "refine_step": self.state.steps,
            "clusters_after_refine": len(self.state.models),
            "srfca_merges": merges,
        }

    def recluster(self, ask: AskClients) -> None:
        """Every client with an own model to its nearest cluster model; clusters left with at
        most t clients dropped (their clients in none)."""
        p, s = self.params, self.state
        who = self.owned()
        ids, dist = self.to_clusters(who, ask)
        s.labels[who] = np.array(ids)[dist.argmin(1)]
        for k in ids:
            if int((s.labels == k).sum()) <= p.size_threshold:
                s.labels[s.labels == k] = -1
                del s.models[k]

    def merge(self, ask: AskClients) -> int:
        """Clusters whose models are within lambda joined (pivot clustering of the clusters); a
        merged model is its parts' mean weighted by their members. Returns the merges."""
        s = self.state
        ids = sorted(s.models)
        if len(ids) < 2:
            return 0
        merges = 0
        d = self.cluster_distances(ids, ask)
        for group in pivot_clusters(d <= s.threshold, self.order(len(ids), s.steps + 1), 0):
            if len(group) < 2:
                continue
            parts = [ids[g] for g in group]
            weights = [float((s.labels == k).sum()) for k in parts]
            keep = min(parts)
            s.models[keep] = torch.stack([w * s.models[k] for w, k in zip(weights, parts)]).sum(0) / sum(weights)
            for k in parts:
                if k != keep:
                    s.labels[s.labels == k] = keep
                    del s.models[k]
            merges += len(parts) - 1
        return merges

    def drifted(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """A client whose data changed trains its own model anew (INIT for it alone), its cross
        losses with the clients present are taken again, and it joins the cluster model of
        lowest train loss; later reclusterings use the new own model."""
        p, s = self.params, self.state
        if not s.models:
            return {}  # INIT has not run: it will meet the new data
        mine = [i for i in clients if i in s.local]
        if not mine:
            return {}
        trained = ask([self.local_training(round_, i, s.w, purpose=7, epochs=p.init_epochs) for i in mine])
        s.local.write({i: r.weights for i, r in zip(mine, trained)})
        if p.metric == "cross_entropy":
            who = [i for i in self.ctx.present_at(round_) if i in s.local]
            models = [s.local.get(j) for j in who]
            on_new = train_losses(mine, models, ask)  # (mine, who): every own model on the new data
            new_on = train_losses(who, [r.weights for r in trained], ask)  # (who, mine): new models on theirs
            rows = {i: s.cross.get(i).clone() for i in set(who) | set(mine)}
            for a, i in enumerate(mine):
                rows[i][who] = torch.from_numpy(on_new[a]).float()
            for b, j in enumerate(who):
                rows[j][mine] = torch.from_numpy(new_on[b]).float()
            s.cross.write(rows)
        for pl in self.place_new(mine, ask):
            s.labels[pl.client] = pl.cluster
        return {"own_models_retrained": len(mine)}

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        s = self.state
        if not s.models:
            return self.init(round_, ask)
        self.train_clusters(round_, sampled, ask)  # clients in no cluster first placed by lowest loss
        s.since += 1
        if s.steps < self.params.refine_steps and s.since >= self.params.refine_rounds:
            return self.refine(ask)
        return {}

    # arrivals are met when sampled (train_clusters), not placed on arrival as the one-shot methods do
    arrive = Algorithm.arrive

    # ---- what users see ----------------------------------------------------------------------
    def global_model(self) -> torch.Tensor:
        return (
            mean_model([self.state.models[k] for k in sorted(self.state.models)]) if self.state.models else self.state.w
        )

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        if not self.state.models:
            return super().place_new(clients, ask)
        return place_by_lowest_loss(clients, self.state.models, ask)
