"""StoCFL: stochastic clustered federated learning (Zeng et al., 2023), Algorithm 1.

Per round t with sampled clients S_t:

1. every i in S_t not seen before sends Psi(D_i) once and opens a singleton cluster (a zero or
   non-finite Psi is rejected: that client stays unclustered, trains w only, and is asked
   again when next sampled);
2. greedily merge the most similar pair of clusters while cos > tau (``ClusterSet``), merging
   their models weighted by the samples that trained them (an untrained model weighs 0);
   tau = "auto" is decided from the first 3 or more representations, with no merges before;
3. a cluster that no client has trained yet starts from the model of its most similar trained
   cluster, or from w when there is none (paper section 4.4);
4. each clustered i in S_t, in cluster k, receives (w, theta_k) and returns
   theta_k^i  = local SGD on f_i(theta) + (lambda/2)||theta - w||^2 from theta_k, and
   w^i        = local SGD on f_i(w) from w (the same mini-batch order as theta_k^i);
5. w <- mean of all w^i (weighted by |D_i|); theta_k <- mean of its members' theta_k^i
   (weighted by |D_i|, or uniform as in the authors' code).

Degenerate cases: tau = 1 never merges (Ditto-like); tau = -1 puts every client in one
cluster whose model then follows FedProx's local objective toward w with mu = lambda;
tau = -1 and lambda = 0 is FedAvg, number for number.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field, field_validator

from stocfl.algorithms.aggregation import weighted_mean
from stocfl.algorithms.base import Algorithm, AskClients, Context, Params, Placement
from stocfl.algorithms.fedavg import CHAIN
from stocfl.algorithms.stocfl.clustering import ClusterSet, valid_representation
from stocfl.algorithms.stocfl.representation import Represent, Represented, count_sketch
from stocfl.bounds import MAX_COUNT, MAX_EPOCHS, MAX_LR, MAX_WEIGHT
from stocfl.client.models import linear_anchor_weights
from stocfl.client.tasks import task_seed
from stocfl.client.training import LocalTraining

log = logging.getLogger("stocfl")
PLOT_DIM = 1024  # per-client vectors too many to keep at full size are sketched to this many numbers
KEEP_FULL_NUMBERS = 2**24  # kept Psi stay full size while N x dim(Psi) is at most this (64 MiB in float32)
AUTO_TAU_MIN = 3  # tau = "auto" waits for this many representations


class StoCFLParams(Params):
    tau: float | Literal["auto"] = Field(
        0.5,
        description="merge threshold tau in [-1, 1]: merge while cos > tau; 'auto' = suggested from the first "
        f"{AUTO_TAU_MIN} or more representations (metrics: tau, tau_auto)",
    )
    lam: float = Field(
        0.05,
        ge=0,
        le=MAX_WEIGHT,
        alias="lambda",
        description="lambda: weight of the proximal pull of cluster models toward w",
    )
    representation: Literal["gradient", "update"] = Field(
        "update", description="Psi: normalised gradient of the anchor, or anchor minus its locally trained copy"
    )
    anchor: Literal["init", "linear"] = Field(
        "linear", description="anchor psi: the initial global model w_0, or a seeded random linear model"
    )
    psi_epochs: int = Field(20, ge=1, le=MAX_EPOCHS, description="E_psi: local epochs of the 'update' representation")
    psi_batch_size: int = Field(
        50, ge=0, le=MAX_COUNT, description="batch size of the 'update' representation (0 = full)"
    )
    psi_lr: float = Field(0.1, gt=0, le=MAX_LR, description="learning rate of the 'update' representation")
    dim: int = Field(
        0, ge=0, le=2**24, description="client-side random projection (count sketch) of Psi; 0 = full size"
    )
    weighting: Literal["samples", "uniform"] = Field(
        "samples", description="aggregate theta_k by |D_i| or uniformly (the authors' code)"
    )
    leave_out: float = Field(
        0.0,
        ge=0,
        lt=0.5,
        description="merge check against crafted Psi: a merge must also hold with this fraction "
        "of the two clusters' most influential members left out (at least 1); 0 = off. Keeps every client's Psi",
    )
    quorum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="merge check against crafted Psi: more than this share of each cluster's members must "
        "agree to a merge (their own Psi's cosine to the other cluster above quorum_tau); 0 = off, 0.5 = a "
        "majority. Keeps every client's Psi",
    )
    quorum_tau: float = Field(
        0.35,
        ge=-1,
        le=1,
        description="the cosine to the other cluster above which a member agrees to a merge (quorum)",
    )
    chain: bool = Field(False, description=CHAIN)
    keep_representations: bool = Field(
        True,
        description=f"keep each client's Psi for plots and the tau helper (full size while N x dim(Psi) <= "
        f"{KEEP_FULL_NUMBERS}, else sketched to {PLOT_DIM} numbers)",
    )

    model_config = ConfigDict(populate_by_name=True)

    @field_validator("tau")
    @classmethod
    def _tau_range(cls, v):
        if v != "auto" and not -1.0 <= v <= 1.0:
            raise ValueError("tau must be in [-1, 1] or 'auto'")
        return v


class StoCFL(Algorithm):
    """Stochastic clustered FL.

    Parameters
    ----------
    tau : float in [-1, 1] or "auto", default 0.5
        Merge threshold (paper's tau).
    lambda : float, default 0.05
        Proximal weight lambda of the bi-level objective (paper eq. 3).
    representation : {"gradient", "update"}, default "update"
        Psi = normalize(psi - psi after E_psi local epochs) (the authors' code) or the
        normalised gradient of psi on D_i (the paper's text).
    anchor : {"init", "linear"}, default "linear"
        psi = a seeded random linear softmax model (paper Fig. 2), or w_0. The defaults
        separate the true groups best of the four on MNIST: same-group cosines tight and far
        above the cross-group ones, so the paper's tau = 0.5 works in every scenario (the
        figures: docs, measured figures, "StoCFL: choosing the defaults").
    dim : int, default 0
        Count-sketch dimension of Psi computed client-side (0 = full size).
    weighting : {"samples", "uniform"}, default "samples"
    leave_out : float in [0, 0.5), default 0 (off)
        The merge check (``stocfl.algorithms.stocfl.clustering``): a merge must also hold with the
        max(1, floor(leave_out * members)) most influential members of the pair left out.
    quorum : float in [0, 1), default 0 (off)
        The members' quorum (``stocfl.algorithms.stocfl.clustering``): a merge must be agreed by
        more than this share of each cluster's members.
    quorum_tau : float in [-1, 1], default 0.35
        A member agrees when its own Psi's cosine to the other cluster exceeds it: between the
        cross-group cosines of members (at most 0.25) and the same-group ones (0.45 and up) of
        the default Psi on MNIST and digits. With quorum 0.5 it kept up to 10 colluders of 40 from
        merging two true clusters, at no cost to clean clustering (docs: StoCFL, "Crafted
        representations").
    chain : bool, default False
        Train w as the authors' code does (``FedAvg``'s ``chain``), not as the paper states.
    """

    name = "stocfl"
    placement = (
        "the cosine of the client's Psi to each cluster's: it joins the closest cluster when the cosine "
        ">= tau, else it would open a new one; either way it is predicted with the closest cluster's model"
    )
    Params = StoCFLParams
    params: StoCFLParams

    @dataclass
    class State:
        w: torch.Tensor  # the global model
        clusters: ClusterSet  # the partition and each cluster's sum of Psi
        theta: dict[int, torch.Tensor]  # trained cluster models only
        trained: dict[int, float]  # samples that have trained each theta_k
        reps: dict[int, torch.Tensor]  # per-client Psi for plots (optional)
        tau: float | None  # None: "auto" and not decided yet
        tau_note: str
        anchor: torch.Tensor  # psi, the model Psi is computed from

    state: State

    def __init__(self, params: StoCFLParams, ctx: Context):
        super().__init__(params, ctx)
        if params.anchor == "linear":
            anchor = linear_anchor_weights(ctx.input_shape, ctx.n_classes, ctx.seed + 7919)
        else:
            anchor = ctx.init_weights.clone()
        self.state = self.State(
            w=ctx.init_weights.clone(),
            clusters=ClusterSet(
                ctx.n_clients, keep_vectors=params.leave_out > 0 or params.quorum > 0 or ctx.drift_notice
            ),
            theta={},
            trained={},
            reps={},
            tau=params.tau if params.tau != "auto" else None,
            tau_note="" if params.tau != "auto" else f"waiting: 0 of {AUTO_TAU_MIN} representations, no merges yet",
            anchor=anchor,
        )

    # ---- clustering ------------------------------------------------------------------------
    def represent_task(self, client: int) -> Represent:
        p = self.params
        return Represent(
            client,
            self.state.anchor,
            p.representation,
            "train" if p.anchor == "init" else "linear",
            LocalTraining.sgd(p.psi_epochs, p.psi_batch_size, p.psi_lr),
            task_seed(self.ctx.seed, 0, client, 2),
            p.dim,
            self.ctx.seed + 104729,
        )

    def _merge_models(self, keep: int, gone: int) -> None:
        a, b = self.state.trained.get(keep, 0.0), self.state.trained.get(gone, 0.0)
        if b > 0:
            self.state.theta[keep] = (
                weighted_mean([self.state.theta[keep], self.state.theta[gone]], [a, b])
                if a > 0
                else self.state.theta[gone]
            )
            self.state.trained[keep] = a + b
        self.state.theta.pop(gone, None)
        self.state.trained.pop(gone, None)

    def model_of(self, cid: int) -> torch.Tensor:
        """theta_k; for an untrained cluster the model of its most similar trained cluster, or w."""
        return self.models_of([cid])[cid]

    def models_of(self, cids: Iterable[int]) -> dict[int, torch.Tensor]:
        """:meth:`model_of` of each of ``cids``. The trained clusters' unit representations are
        made once for all the untrained ones: with a model-sized Psi they are a (clusters x
        parameters) float64 matrix, 2.4 GB for 244 clusters of FEMNIST's CNN, which was made
        again for every newcomer's cluster of a round."""
        out: dict[int, torch.Tensor] = {}
        trained: list[int] | None = None
        units: torch.Tensor | None = None
        for cid in cids:
            if cid in self.state.theta:
                out[cid] = self.state.theta[cid]
                continue
            if trained is None:
                trained = [c for c in self.state.clusters.ids if c in self.state.theta]
            if not trained:
                out[cid] = self.state.w
                continue
            if units is None:
                units = self.state.clusters.units(trained, scratch=True)
            sims = units @ self.state.clusters.unit(cid)
            out[cid] = self.state.theta[trained[int(torch.argmax(sims))]]
        return out

    def cluster_newcomers(
        self, results: list[Represented], clients: list[int], changed: Sequence[int] = ()
    ) -> tuple[list[int], int]:
        """Add valid representations as singletons, then merge (the clusters ``changed`` are
        candidates too); returns (accepted, merges)."""
        accepted, fresh = [], list(changed)
        for i, r in zip(clients, results):
            if not valid_representation(r.psi):
                continue  # rejected
            fresh.append(self.state.clusters.add(i, r.psi))
            accepted.append(i)
            if self.params.keep_representations:
                self.state.reps[i] = self._kept(r.psi)
        if self.state.tau is None:
            self.decide_tau()
            if self.state.tau is None:
                return accepted, 0  # no merges until tau is decided: clusters stay singletons
        return accepted, self.state.clusters.merge_greedy(
            fresh,
            self.state.tau,
            self._merge_models,
            leave_out=self.params.leave_out,
            quorum=self.params.quorum,
            quorum_tau=self.params.quorum_tau,
        )

    def _kept(self, psi: torch.Tensor) -> torch.Tensor:
        """Psi as kept for plots and ``tau_suggested``: full size where all N fit, else sketched
        (an estimate: cosines move by about 1/sqrt(PLOT_DIM)). A resumed run keeps its size."""
        if self.state.reps:
            full = next(iter(self.state.reps.values())).numel() == psi.numel()
        else:
            full = self.ctx.n_clients * psi.numel() <= KEEP_FULL_NUMBERS
        return psi if full or psi.numel() <= PLOT_DIM else count_sketch(psi, PLOT_DIM, 1)

    def decide_tau(self) -> None:
        """tau = "auto": suggested (``stocfl.algorithms.stocfl.tau``) from the first AUTO_TAU_MIN representations
        received, full size. Until then no cluster has merged, so each cluster's sum is one
        client's Psi and no per-client vector needs keeping."""
        from stocfl.algorithms.stocfl.tau import tau_cuts

        ids = self.state.clusters.ids
        if len(ids) >= AUTO_TAU_MIN:
            best, *others = tau_cuts(torch.stack([self.state.clusters.sums_[c].double() for c in ids]))
            self.state.tau = best.tau
            self.state.tau_note = (
                f"suggested from {len(ids)} representations: {best.clusters} clusters (gap {best.gap:.3f})"
            )
            if others:  # a runner-up nearly as wide is a second reading of the same data
                self.state.tau_note += (
                    f"; next widest gap: tau {others[0].tau} for {others[0].clusters} clusters "
                    f"(gap {others[0].gap:.3f})"
                )
        else:
            self.state.tau_note = f"waiting: {len(ids)} of {AUTO_TAU_MIN} representations, no merges yet"

    # ---- the round ---------------------------------------------------------------------------
    def arrive(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """Arrivals send Psi in the round they arrive and join the partition as sampled newcomers
        do (steps 1-2), before they are ever sampled (paper section 4.4: new clients placed at
        any time)."""
        new = [i for i in clients if self.state.clusters.labels_[i] < 0]
        if not new:
            return {}
        accepted, merges = self.cluster_newcomers(ask([self.represent_task(i) for i in new]), new)
        return {"arrivals_clustered": len(accepted), "arrival_merges": merges}

    def drifted(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """A client whose data changed is a new client: its old Psi leaves its cluster (a
        cluster left empty goes, with its model), and its new Psi is clustered as an
        arrival's is (the representation is of the client's data, so it is redone when they
        change). A client never represented is met when it is sampled, as before."""
        known = [i for i in clients if self.state.clusters.labels_[i] >= 0]
        if not known:
            return {}
        changed = []
        for i in known:
            k = int(self.state.clusters.labels_[i])
            kept = self.state.clusters.remove(i)
            if kept is None:
                self.state.theta.pop(k, None)
                self.state.trained.pop(k, None)
            elif kept not in changed:
                changed.append(kept)
            self.state.reps.pop(i, None)
        changed = [k for k in changed if k in self.state.clusters.sums_]
        accepted, merges = self.cluster_newcomers(ask([self.represent_task(i) for i in known]), known, changed)
        return {"drift_reclustered": len(accepted), "drift_merges": merges}

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        labels = self.state.clusters.labels_
        new = [i for i in sampled if labels[i] < 0]
        self.state.clusters.refused = 0
        accepted, merges = self.cluster_newcomers(ask([self.represent_task(i) for i in new]), new) if new else ([], 0)
        rejected = sorted(set(new) - set(accepted))
        members = [i for i in sampled if labels[i] >= 0]  # a client whose Psi was rejected trains w only
        start = self.models_of(sorted({int(labels[i]) for i in members}))
        tasks = [
            self.local_training(round_, i, start[int(labels[i])], prox_center=self.state.w, prox_weight=self.params.lam)
            for i in members
        ]
        if not self.params.chain:
            tasks += [self.local_training(round_, i, self.state.w) for i in sampled]
        results = ask(tasks)
        thetas, ws = results[: len(members)], results[len(members) :]
        if self.params.chain:
            self.state.w = self.chain(
                sampled, lambda i, start: self.local_training(round_, i, start), self.state.w, ask
            )
        elif ws:
            self.state.w = self.aggregate(ws, self.state.w)
        for k in start:
            mine = [r for i, r in zip(members, thetas) if labels[i] == k]
            weights = [r.n_samples for r in mine] if self.params.weighting == "samples" else [1.0] * len(mine)
            self.state.theta[k] = self.aggregate(mine, start[k], weights)
            self.state.trained[k] = self.state.trained.get(k, 0.0) + float(sum(r.n_samples for r in mine))
        objective = self.state.clusters.objective()
        self.state.clusters.release_scratch()  # gigabytes with a model-sized Psi: not held between rounds
        out: dict[str, Any] = {
            "objective": objective,
            "merges": merges,
            "new_clients": len(accepted),
            "rejected_representations": len(rejected),
            "tau": self.state.tau,
        }
        if self.params.tau == "auto":
            out["tau_auto"] = self.state.tau_note
        if self.params.leave_out > 0 or self.params.quorum > 0:
            out["merges_refused"] = self.state.clusters.refused
        return out

    # ---- what users see ----------------------------------------------------------------------
    def global_model(self) -> torch.Tensor:
        return self.state.w

    def client_models(self, clients: list[int], ask: AskClients) -> list[torch.Tensor]:
        labels = self.state.clusters.labels_
        models = self.models_of(sorted({int(labels[i]) for i in clients if labels[i] >= 0}))
        self.state.clusters.release_scratch()
        # a client not sampled yet has no representation: the global model
        return [models[int(labels[i])] if labels[i] >= 0 else self.state.w for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return self.state.clusters.labels_.copy()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        models = self.models_of(self.state.clusters.ids)
        self.state.clusters.release_scratch()
        return models

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """New clients after training (paper 4.4): each sends Psi; with max cosine d >= tau it
        joins the argmax cluster, otherwise it would open a new cluster; either way it is
        predicted with the closest cluster's model. The partition itself is not changed."""
        tau = self.state.tau
        if tau is None:
            log.warning(
                "tau = 'auto' is still undecided (%s): new clients join their closest cluster", self.state.tau_note
            )
            tau = -1.0
        out = []
        for i, r in zip(clients, ask([self.represent_task(i) for i in clients])):
            if not valid_representation(r.psi):
                out.append(Placement(i, -1, None, True, self.state.w))
                continue
            k, sim, joins = self.state.clusters.lookup(r.psi, tau)
            out.append(Placement(i, k, sim, not joins, self.model_of(k) if k >= 0 else self.state.w))
        return out

    def summary(self, rows):
        out = {k: v for k, v in rows[-1].items() if k in ("objective", "tau")} if rows else {}
        if len(self.state.reps) >= 3:
            from stocfl.algorithms.stocfl.tau import suggest_tau

            ids, reps = self.representations()
            out["tau_suggested"] = suggest_tau(reps)
            sent = self.params.dim or self.state.anchor.numel()
            out["tau_suggested_from"] = f"Psi of {len(ids)} clients" + (
                "" if reps.shape[1] == sent else f", sketched from {sent} to {reps.shape[1]} numbers (an estimate)"
            )
        return out

    def representations(self):
        ids = sorted(self.state.reps)
        return (ids, torch.stack([self.state.reps[i] for i in ids])) if ids else None
