"""Stochastic client clustering (StoCFL, Zeng et al. 2023, section 3.2 and Algorithm 1).

The server keeps, per cluster, the SUM of its members' representations Psi and their count:
never one full vector per client. Cosine is scale-free, so the sum stands for the mean.

Each round the newly sampled clients join as singletons; then, greedily, the pair of clusters
with the highest cosine similarity is merged while that similarity exceeds tau (centroid
linkage; the merged centroid is recomputed after every merge). Before the round every pair of
clusters is at or below tau, so only pairs that involve a cluster changed this round (a
"dirty" one) can exceed it: the loop keeps the similarities of dirty clusters to all
clusters, (dirty x K), and updates one row and one column per merge. A round costs
O((newcomers + merges) * K * dim), independent of the number of clients N.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch


class ClusterSet:
    """A partition of the clients seen so far, by representation.

    Attributes
    ----------
    labels_ : np.ndarray of shape (N,)
        Cluster id of every client, -1 for clients not seen yet.
    sums_, counts_ : dict[int, Tensor], dict[int, int]
        Per cluster: sum of members' Psi and number of members.
    """

    def __init__(self, n_clients: int):
        self.labels_ = np.full(n_clients, -1, dtype=np.int64)
        self.sums_: dict[int, torch.Tensor] = {}
        self.counts_: dict[int, int] = {}
        self.members_: dict[int, list[int]] = {}
        self.next_id = 0

    @property
    def ids(self) -> list[int]:
        return sorted(self.sums_)

    def __len__(self) -> int:
        return len(self.sums_)

    def unit(self, cid: int) -> torch.Tensor:
        s = self.sums_[cid].double()
        n = s.norm()
        return s / n if n > 0 else s

    def units(self, ids: list[int]) -> torch.Tensor:
        return torch.stack([self.unit(c) for c in ids]) if ids else torch.zeros(0, 0, dtype=torch.float64)

    def add(self, client: int, psi: torch.Tensor) -> int:
        """Client ``client`` joins as a new singleton cluster; returns its id."""
        cid = self.next_id
        self.next_id += 1
        self.sums_[cid] = psi.detach().float().clone()
        self.counts_[cid] = 1
        self.members_[cid] = [client]
        self.labels_[client] = cid
        return cid

    def join(self, client: int, cid: int, psi: torch.Tensor) -> None:
        self.sums_[cid] += psi.float()
        self.counts_[cid] += 1
        self.members_[cid].append(client)
        self.labels_[client] = cid

    def similarities(self, psi: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Cosine of ``psi`` to every cluster representation."""
        ids = self.ids
        if not ids:
            return ids, torch.zeros(0, dtype=torch.float64)
        p = psi.double()
        p = p / p.norm() if p.norm() > 0 else p
        return ids, self.units(ids) @ p

    def objective(self) -> float:
        """Paper eq. (2): sum over pairs i < j of cos(Psi(D~_i), Psi(D~_j))."""
        u = self.units(self.ids)
        if len(u) < 2:
            return 0.0
        return float((u.sum(0).pow(2).sum() - (u * u).sum()) / 2)

    def merge_greedy(self, dirty: list[int], tau: float, on_merge: Callable[[int, int], None] | None = None,
                     heights: list[float] | None = None) -> int:
        """Merge the most similar pair while its cosine exceeds ``tau``; returns the number of merges.

        ``dirty``: clusters changed since the last call (newcomers). ``on_merge(keep, gone)`` is
        called before cluster ``gone`` is folded into ``keep`` (the older id is kept); the cosine
        of every merge is appended to ``heights`` when given."""
        ids = self.ids
        slot = {c: i for i, c in enumerate(ids)}
        u = self.units(ids)
        dead = torch.zeros(len(ids), dtype=torch.bool)
        first = sorted({slot[c] for c in dirty if c in slot})
        if not first:
            return 0
        # one row per dirty cluster; every merge adds at most one, so allocate that up front
        cap = 2 * len(first) + 1
        sims = torch.full((cap, len(ids)), -np.inf, dtype=torch.float64)
        row_slot = torch.full((cap,), -1, dtype=torch.long)  # cluster slot of each row, -1 = none
        slot_row = torch.full((len(ids),), -1, dtype=torch.long)
        first_t = torch.tensor(first)
        sims[: len(first)] = u[first_t] @ u.T
        sims[torch.arange(len(first)), first_t] = -np.inf
        row_slot[: len(first)] = first_t
        slot_row[first_t] = torch.arange(len(first))
        n_rows = len(first)
        best, arg = sims.max(dim=1)  # cached maximum of every row
        merges = 0
        while True:
            r = int(torch.argmax(best[:n_rows]))
            if not float(best[r]) > tau:
                break
            a, b = ids[int(row_slot[r])], ids[int(arg[r])]
            keep, gone = min(a, b), max(a, b)
            if on_merge is not None:
                on_merge(keep, gone)
            if heights is not None:
                heights.append(float(best[r]))
            self.sums_[keep] += self.sums_.pop(gone)
            self.counts_[keep] += self.counts_.pop(gone)
            moved = self.members_.pop(gone)
            self.labels_[moved] = keep
            self.members_[keep] += moved
            merges += 1
            ks, gs = slot[keep], slot[gone]
            dead[gs] = True
            u[ks] = self.unit(keep)
            if slot_row[gs] >= 0:  # the folded cluster's row goes
                gr = int(slot_row[gs])
                sims[gr], best[gr], row_slot[gr], slot_row[gs] = -np.inf, -np.inf, -1, -1
            if slot_row[ks] < 0:  # the merged cluster is dirty now
                slot_row[ks], row_slot[n_rows] = n_rows, ks
                n_rows += 1
            kr = int(slot_row[ks])
            live = torch.nonzero(row_slot[:n_rows] >= 0).squeeze(1)
            # the merged cluster's row, and its column in every dirty row
            row = u @ u[ks]
            row[dead] = -np.inf
            row[ks] = -np.inf
            sims[kr] = row
            col = u[row_slot[live]] @ u[ks]
            col[row_slot[live] == ks] = -np.inf
            sims[live, ks] = col
            sims[live, gs] = -np.inf
            # rows whose cached best pointed at a changed column are recomputed at once; the
            # others only compare with the new value in column ks
            stale = live[(arg[live] == ks) | (arg[live] == gs) | (live == kr)]
            if len(stale):
                best[stale], arg[stale] = sims[stale].max(dim=1)
            better = sims[live, ks] > best[live]
            best[live[better]] = sims[live[better], ks]
            arg[live[better]] = ks
        return merges

    def lookup(self, psi: torch.Tensor, tau: float) -> tuple[int, float, bool]:
        """Most similar cluster to ``psi``, the cosine, and whether it reaches tau (paper 4.4)."""
        ids, sims = self.similarities(psi)
        if not ids:
            return -1, float("nan"), False
        k = int(torch.argmax(sims))
        return ids[k], float(sims[k]), bool(sims[k] >= tau)

    # ---- state ---------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        ids = self.ids
        tensors = {"cluster_sums": torch.stack([self.sums_[c] for c in ids])} if ids else {}
        return tensors, {"ids": ids, "counts": [self.counts_[c] for c in ids], "next_id": self.next_id,
                         "labels": self.labels_.tolist()}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        ids = meta["ids"]
        self.sums_ = {c: tensors["cluster_sums"][k].clone() for k, c in enumerate(ids)}
        self.counts_ = dict(zip(ids, meta["counts"]))
        self.next_id = meta["next_id"]
        self.labels_ = np.asarray(meta["labels"], dtype=np.int64)
        self.members_ = {c: np.flatnonzero(self.labels_ == c).tolist() for c in ids}
