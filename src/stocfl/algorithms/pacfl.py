"""PACFL: clustered FL by principal angles between client data subspaces (Vahidian et al.,
AAAI 2023)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from stocfl.algorithms.base import AskClients, Context, OneShotClusters, Params, Placement
from stocfl.bounds import MAX_COUNT
from stocfl.client.subspace import Subspace, Subspaced
from stocfl.client.tasks import without_dropped
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore

# beta, the angle (degrees) below which two clusters merge, when none is given. The authors
# tune it per data set (their scripts: 4.9 for CIFAR-10 with two labels a client, 9.88 for
# CIFAR-100); ours was measured on rotated and label-swapped MNIST (docs/algorithms/pacfl.md).
DEFAULT_THRESHOLD = 15.0
LINKAGE = {"average": "weighted", "complete": "complete", "single": "single"}  # ours -> scipy's


class PACFLParams(Params):
    n_basis: int = Field(3, ge=1, le=1000, description="p: left singular vectors a client sends per label")
    threshold: float = Field(
        0.0,
        ge=0,
        le=90,
        description=f"beta: clusters closer than this angle (degrees) merge; 0 = {DEFAULT_THRESHOLD:g} "
        "unless n_clusters is set",
    )
    n_clusters: int = Field(0, ge=0, le=MAX_COUNT, description="cut the tree into this many clusters instead")
    linkage: Literal["average", "complete", "single"] = Field(
        "average", description="average: the two merged rows' mean, the authors' rule (WPGMA)"
    )

    @model_validator(mode="after")
    def _one_cut(self):
        if self.threshold > 0 and self.n_clusters > 0:
            raise ValueError("set one of threshold and n_clusters, not both")
        if not self.threshold and not self.n_clusters:
            self.threshold = DEFAULT_THRESHOLD
        return self


def proximity(bases: list[torch.Tensor], others: list[torch.Tensor] | None = None) -> np.ndarray:
    """A[i, j] in degrees between client i of ``bases`` and client j of ``others`` (default:
    ``bases``), each a (k, d) float64 matrix of unit rows: the smallest angle between a row u of
    one and a row v of the other, arccos max |u . v| (the authors' code). The sign of a
    singular vector is arbitrary, so it is the angle between lines, in [0, 90]."""
    others = bases if others is None else others
    pad = max([len(b) for b in [*bases, *others]] + [1])

    def padded(group):  # zero rows do not change the largest |u . v|
        out = torch.zeros((len(group), pad, group[0].shape[1] if group else 0), dtype=torch.float64)
        for i, b in enumerate(group):
            out[i, : len(b)] = b
        return out

    right = padded(others)
    cos = torch.zeros((len(bases), len(others)), dtype=torch.float64)
    for i, b in enumerate(bases):
        m = torch.einsum("ad,jbd->jab", b, right)  # (others, k_i, pad)
        cos[i] = m.abs().amax((1, 2))
    return torch.rad2deg(torch.arccos(cos.clamp(0.0, 1.0))).numpy()


def cut_tree(a: np.ndarray, linkage: str, threshold: float, n_clusters: int) -> np.ndarray:
    """Agglomerative clustering of the proximity matrix ``a``: merge the closest two clusters
    until the closest are beyond ``threshold`` (or ``n_clusters`` remain); labels 0.. in order
    of each cluster's lowest client."""
    from scipy.cluster.hierarchy import fcluster
    from scipy.cluster.hierarchy import linkage as tree
    from scipy.spatial.distance import squareform

    n = len(a)
    if n < 2:
        return np.zeros(n, dtype=np.int64)
    z = tree(squareform((a + a.T) / 2, checks=False), method=LINKAGE[linkage])
    raw = fcluster(z, n_clusters, "maxclust") if n_clusters else fcluster(z, threshold, "distance")
    first: dict[int, int] = {}
    return np.array([first.setdefault(int(k), len(first)) for k in raw], dtype=np.int64)


class PACFL(OneShotClusters):
    """Once, before training: every participant sends the first p = ``n_basis`` left singular
    vectors of each label's data (:class:`~stocfl.client.subspace.Subspace`); the server forms
    the proximity matrix A of the angles between the clients' subspaces (:func:`proximity`) and
    clusters it hierarchically (``linkage``), merging while the closest clusters are within
    beta = ``threshold`` degrees (or into ``n_clusters``). Then, every round, FedAvg within each
    cluster over its sampled members; every cluster model starts from w_0.

    Settled (docs/algorithms/pacfl.md): the angle is between lines (arccos |u . v|), where the
    authors' code takes arccos of the signed product, which a singular vector's arbitrary sign
    can turn into its supplement; a participant that fails the clustering query, and a new
    client, sends its subspace when it is first needed and joins the cluster at the least mean
    angle to its members (the linkage's own rule for single and complete: least minimum or
    maximum), without re-clustering.

    Parameters
    ----------
    n_basis : int, default 3
    threshold : float, default 10.0 degrees (unless n_clusters)
    n_clusters : int, default 0 (cut by threshold)
    linkage : {"average", "complete", "single"}, default "average"
    """

    name = "pacfl"
    placement = "the cluster at the least angle between its subspace and the members' (the linkage's rule)"
    Params = PACFLParams
    params: PACFLParams

    @dataclass
    class State:
        w: torch.Tensor  # w_0, where every cluster starts (and the stand-in global model)
        labels: np.ndarray  # cluster of every client; -1: not placed
        models: dict[int, torch.Tensor]  # cluster id -> model; empty until the clustering step
        bases: ClientStore  # each client's basis rows, padded with zeros (N x p*C*d)
        columns: np.ndarray  # how many rows of a client's basis are set

    state: State

    def __init__(self, params: PACFLParams, ctx: Context):
        super().__init__(params, ctx)
        if ctx.n_classes < 1 or not ctx.input_shape:
            raise UserError("pacfl needs Context.n_classes and Context.input_shape (its query's size)")
        self.dim = int(np.prod(ctx.input_shape))
        width = params.n_basis * ctx.n_classes * self.dim
        if width * ctx.n_clients * 4 > 64 << 30:
            raise UserError(
                f"config: algorithm.n_basis = {params.n_basis}: {ctx.n_clients} clients' bases of "
                f"{params.n_basis * ctx.n_classes} x {self.dim} entries need more than 64 GiB; lower it"
            )
        self.state = self.State(
            ctx.init_weights.clone(),
            np.full(ctx.n_clients, -1, dtype=np.int64),
            {},
            ctx.store("pacfl_bases", width),
            np.zeros(ctx.n_clients, dtype=np.int64),
        )

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if not self.state.models:
            out = self.cluster(round_, ask)
            if not self.state.models:
                return out
        self.train_clusters(round_, sampled, ask)
        return out

    def query(self, clients: list[int], ask: AskClients) -> list[torch.Tensor]:
        """The clients' bases, (k_i, d) float64 each, asked for and kept in the store."""
        p = self.params
        replies: list[Subspaced] = ask([Subspace(i, p.n_basis, self.dim, self.ctx.n_classes) for i in clients])
        width = self.state.bases.p
        rows = {}
        for i, r in zip(clients, replies):
            rows[i] = torch.cat([r.basis, torch.zeros(width - r.basis.numel())])
            self.state.columns[i] = r.n_columns
        self.state.bases.write(rows)
        return [self.basis(i) for i in clients]

    def basis(self, i: int) -> torch.Tensor:
        k = int(self.state.columns[i])
        return self.state.bases.get(i)[: k * self.dim].reshape(k, self.dim).double()

    def cluster(self, round_: int, ask: AskClients) -> dict[str, Any]:
        """The one clustering step over every participant present that answers."""
        p = self.params
        everyone, bases = without_dropped(
            self.ctx.present_at(round_), lambda clients: self.query(clients, ask), "PACFL's subspace query"
        )
        if not everyone:  # nobody answered: tried again next round
            return {"clustered": 0}
        a = proximity(bases)
        self.state.labels[everyone] = cut_tree(a, p.linkage, p.threshold, p.n_clusters)
        self.state.models = {int(k): self.state.w.clone() for k in np.unique(self.state.labels[everyone])}
        upper = a[np.triu_indices(len(a), 1)]
        return {
            "clustered": len(self.state.models),
            "clustered_clients": len(everyone),
            # the angles of the closest and farthest pairs, to read a threshold off a run
            "pacfl_angles": [round(float(upper.min()), 3), round(float(upper.max()), 3)] if len(upper) else [],
        }

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        if not self.state.models:
            return super().place_new(clients, ask)
        if not clients:
            return []
        placed = [int(i) for i in np.flatnonzero(self.state.labels >= 0)]
        angles = proximity(self.query(clients, ask), [self.basis(j) for j in placed])
        ids = sorted(self.state.models)
        member = np.array([self.state.labels[j] for j in placed])
        reduce: dict[str, Callable[[np.ndarray], float]] = {
            "average": lambda a: float(a.mean()),
            "single": lambda a: float(a.min()),
            "complete": lambda a: float(a.max()),
        }
        out = []
        for i, row in zip(clients, angles):
            to = np.array([reduce[self.params.linkage](row[member == k]) for k in ids])
            best = int(np.argmin(to))
            far = bool(self.params.threshold and to[best] > self.params.threshold)
            out.append(Placement(i, ids[best], None, far, self.state.models[ids[best]]))
        return out
