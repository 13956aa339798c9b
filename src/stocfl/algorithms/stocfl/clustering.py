"""Stochastic client clustering (StoCFL, Zeng et al. 2023, section 3.2 and Algorithm 1).

The server keeps, per cluster, the SUM of its members' representations Psi and their count:
never one full vector per client. Cosine is scale-free, so the sum stands for the mean. A
singleton's sum is its Psi as received (float32, not copied: with the paper's Psi of a
1.6M-parameter model, 480 newcomers of a round are 3 GB so and 6 GB as float64 copies); every
sum of two or more is float64, and every computation on sums is done in float64, so the numbers
are those of float64 sums throughout.

The rule (``merge_greedy``): newly sampled clients join as singletons; then, while the most
similar pair of clusters has a cosine above tau, that pair is merged and its centroid
recomputed (greedy centroid linkage). Cosines are compared at a resolution of ``EPS``, so that
the partition does not depend on the order in which floating-point sums were formed:

* a pair merges only when its cosine exceeds tau by more than EPS;
* cosines within EPS of the highest are ties; among tied pairs the one with the smallest
  (older id, younger id) merges, and the merged cluster keeps the older id.

Incremental evaluation: after a call with threshold tau every pair is at or below tau + EPS, so
the next call with the same tau only needs the pairs that involve a cluster changed since (a
"dirty" one). The loop keeps the similarities of dirty clusters to all clusters, one row per
dirty cluster, and updates one row and one column per merge; a merge can make an older cluster
dirty, so rows are added as needed. A merge needs no pass over the representations: the merged
cluster's cosine to any cluster j is (|S_a| cos(j, a) + |S_b| cos(j, b)) / |S_a + S_b|, from
the two rows it replaces (a clean cluster's row is computed once, when it first merges). A
round costs O((newcomers + clean clusters merged) * K * dim + merges * K), independent of the
number of clients N (a pass over the representations per merge was what made large rounds
slow; docs: measured figures). A call with another tau than the last one treats
every cluster as dirty. ``tests/test_clustering_reference.py`` checks all of this against a
brute-force recomputation on generated inputs.

The optional merge check (``leave_out``, a defence against crafted representations): a pair
that passes tau merges only if it still passes with the r = max(1, floor(leave_out * (|P| +
|Q|))) members left out whose individual removal lowers the pair's cosine most (ties: the
smaller client id), each cluster keeping at least one member. A few crafted Psi placed between
two true clusters then no longer carry them together: the crafted ones are the most
influential members and are left out. A refused pair stays apart until one of its clusters
changes. The check needs every member's Psi, so the set then keeps one vector per client.

The members' quorum (``quorum``, the stronger defence): a pair that passes tau merges only if,
on each side of two or more members, more than the ``quorum`` share of its members agree, a
member agreeing when its own Psi's cosine to the other cluster's representation exceeds tau
(at resolution EPS). A singleton's own cosine is the pair's, which passed. Crafted Psi that
joined cluster A cannot carry A into B while they are fewer than the quorum of A's members:
A's honest members do not point at B. Refused pairs stay apart as above; the quorum also needs
every member's Psi.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

EPS = 1e-9  # resolution of cosine comparisons (ties and the threshold)


def valid_representation(psi: torch.Tensor) -> bool:
    """A finite, non-zero vector: anything else carries no direction."""
    return psi.dim() == 1 and bool(torch.isfinite(psi).all()) and float(psi.double().norm()) > 0.0


class ClusterSet:
    """A partition of the clients seen so far, by representation.

    Attributes
    ----------
    labels_ : np.ndarray of shape (N,)
        Cluster id of every client, -1 for clients not seen yet.
    sums_, counts_ : dict[int, Tensor], dict[int, int]
        Per cluster: sum of members' Psi (float64; a singleton's Psi as given) and number of
        members.
    merged_at : float or None
        The tau of the last ``merge_greedy`` call (every pair is at or below it + EPS).
    """

    def __init__(self, n_clients: int, keep_vectors: bool = False):
        self.labels_ = np.full(n_clients, -1, dtype=np.int64)
        self.keep_vectors = keep_vectors
        self.vectors_: dict[int, torch.Tensor] = {}  # client -> Psi (only with keep_vectors)
        self.refused = 0  # merges refused by the last merge_greedy's check
        self.sums_: dict[int, torch.Tensor] = {}
        self.counts_: dict[int, int] = {}
        self.members_: dict[int, list[int]] = {}
        self.next_id = 0
        self.merged_at: float | None = None
        self._scratch: torch.Tensor | None = None  # the units' memory, kept for the round's next reader

    @property
    def ids(self) -> list[int]:
        return sorted(self.sums_)

    def __len__(self) -> int:
        return len(self.sums_)

    def unit(self, cid: int) -> torch.Tensor:
        s = self.sums_[cid].double()
        n = s.norm()
        return s / n if n > 0 else s

    def units(self, ids: list[int], norms: torch.Tensor | None = None, scratch: bool = False) -> torch.Tensor:
        """The unit representations of clusters ``ids``, one row each, written into one tensor:
        with Psi of a 1.6M-parameter model, a list of per-cluster copies stacked afterwards
        doubled the peak (480 newcomers: 6 GB more). ``norms``, if given, receives |S_c|.

        ``scratch``: written into memory this set keeps until :meth:`release_scratch` (the
        result is valid until the next such call). A round reads the units three times (the
        merge, the untrained clusters' models, the objective); with a model-sized Psi the
        matrix is gigabytes, and the allocator gave each one fresh pages (a freed block over
        its 2 GiB trim threshold goes back to the system), 2.6 GiB of page faults a reading."""
        if not ids:
            return torch.zeros(0, 0, dtype=torch.float64)
        rows, cols = len(ids), self.sums_[ids[0]].numel()
        if scratch:
            if self._scratch is None or self._scratch.shape[0] < rows or self._scratch.shape[1] != cols:
                self._scratch = None  # the old block goes before the new one is made
                self._scratch = torch.empty((rows, cols), dtype=torch.float64)
            out = self._scratch[:rows]
        else:
            out = torch.empty((rows, cols), dtype=torch.float64)
        for k, c in enumerate(ids):
            s = self.sums_[c].double()
            n = s.norm()
            torch.div(s, n, out=out[k]) if n > 0 else out[k].copy_(s)
            if norms is not None:
                norms[k] = n
        return out

    def release_scratch(self) -> None:
        """Free the memory :meth:`units` keeps for its readers (a round's end)."""
        self._scratch = None

    def add(self, client: int, psi: torch.Tensor) -> int:
        """Client ``client`` joins as a new singleton cluster; returns its id. ``psi`` is kept
        as given (no copy) and never modified: the caller must not modify it either."""
        if not valid_representation(psi):
            raise ValueError("a representation must be a finite, non-zero vector")
        if self.labels_[client] >= 0:
            raise ValueError(f"client {client} is already in cluster {self.labels_[client]}")
        cid = self.next_id
        self.next_id += 1
        self.sums_[cid] = psi.detach()
        self.counts_[cid] = 1
        self.members_[cid] = [client]
        self.labels_[client] = cid
        if self.keep_vectors:
            self.vectors_[client] = psi.detach().clone()
        return cid

    def remove(self, client: int) -> int | None:
        """Client ``client`` leaves its cluster (its data changed): its Psi is taken out of the
        cluster's sum, and a cluster left empty is gone. Returns the cluster it left if that
        remains (its representation changed: a merge candidate again), else None. Needs
        ``keep_vectors``."""
        cid = int(self.labels_[client])
        if cid < 0:
            raise ValueError(f"client {client} is in no cluster")
        if client not in self.vectors_:
            raise ValueError("taking a client out needs ClusterSet(keep_vectors=True)")
        v = self.vectors_.pop(client)
        self.labels_[client] = -1
        self.members_[cid].remove(client)
        self.counts_[cid] -= 1
        if not self.counts_[cid]:
            for d in (self.sums_, self.counts_, self.members_):
                d.pop(cid)
            return None
        self.sums_[cid] = self.sums_[cid].double() - v.double()  # a new tensor: a singleton's Psi stays as given
        return cid

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
        u = self.units(self.ids, scratch=True)
        if len(u) < 2:
            return 0.0
        # squared in place: u is this call's own, and a second (clusters x Psi) float64 tensor
        # is gigabytes with a model-sized Psi (244 clusters of FEMNIST's CNN: 2.4 GB)
        total = u.sum(0).pow(2).sum()
        return float((total - u.mul_(u).sum()) / 2)

    def _fold(self, keep: int, gone: int) -> None:
        self.sums_[keep] = self.sums_[keep].double() + self.sums_.pop(gone).double()  # a new tensor: Psi stays as given
        self.counts_[keep] += self.counts_.pop(gone)
        moved = self.members_.pop(gone)
        self.labels_[moved] = keep
        self.members_[keep] += moved

    def leave_out_cosine(self, a: int, b: int, fraction: float) -> float:
        """The cosine of clusters ``a`` and ``b`` with their most influential members left out
        (see the module docstring); needs ``keep_vectors``."""
        sums = (self.sums_[a].double(), self.sums_[b].double())
        members = (self.members_[a], self.members_[b])
        r = max(1, int(fraction * (len(members[0]) + len(members[1]))))
        ranked = []  # (cosine without the member, client, side)
        for side in (0, 1):
            own, other = sums[side], sums[1 - side]
            if len(members[side]) < 2:
                continue
            rest = own[None, :] - torch.stack([self.vectors_[i].double() for i in members[side]])
            cos = (rest @ other) / (rest.norm(dim=1) * other.norm())
            cos = torch.nan_to_num(cos, nan=-2.0)  # a side that sums to zero without it: no direction left
            ranked += [(float(c), i, side) for c, i in zip(cos, members[side])]
        ranked.sort()
        left = [sums[0].clone(), sums[1].clone()]
        room = [len(members[0]) - 1, len(members[1]) - 1]
        for _, i, side in ranked:
            if r == 0:
                break
            if room[side]:
                left[side] -= self.vectors_[i].double()
                room[side] -= 1
                r -= 1
        na, nb = left[0].norm(), left[1].norm()
        return float(left[0] @ left[1] / (na * nb)) if na > 0 and nb > 0 else -2.0

    def agreed(self, a: int, b: int, tau: float, quorum: float) -> bool:
        """Whether, on each side of clusters ``a`` and ``b`` with two or more members, more than
        ``quorum`` of the members have a cosine above ``tau`` (the members' threshold) to the
        other cluster (see the module docstring); needs ``keep_vectors``."""
        for own, other in ((a, b), (b, a)):
            members = self.members_[own]
            if len(members) < 2:
                continue
            u = self.sums_[other].double()
            u = u / u.norm()
            v = torch.stack([self.vectors_[i].double() for i in members])
            cos = (v @ u) / v.norm(dim=1)
            if not int((cos > tau + EPS).sum()) > quorum * len(members):
                return False
        return True

    def merge_greedy(
        self,
        dirty: list[int],
        tau: float,
        on_merge: Callable[[int, int], None] | None = None,
        heights: list[float] | None = None,
        leave_out: float = 0.0,
        quorum: float = 0.0,
        quorum_tau: float | None = None,
    ) -> int:
        """Merge the most similar pair while its cosine exceeds ``tau`` (see the module
        docstring for ties and resolution); returns the number of merges.

        ``dirty``: clusters changed since the last call (newcomers). ``on_merge(keep, gone)`` is
        called before cluster ``gone`` is folded into ``keep`` (the older id); the cosine of
        every merge is appended to ``heights`` when given. ``leave_out`` > 0: the merge check;
        ``quorum`` > 0: the members' quorum, a member agreeing above ``quorum_tau`` (None: tau)
        (module docstring); ``refused`` counts the pairs they kept apart."""
        if (leave_out > 0 or quorum > 0) and not self.keep_vectors:
            raise ValueError("the merge check needs ClusterSet(keep_vectors=True)")
        self.refused = 0
        ids = self.ids
        if self.merged_at is None or tau != self.merged_at:
            dirty = ids  # the invariant of the last call does not hold for this tau
        self.merged_at = tau
        slot = {c: i for i, c in enumerate(ids)}
        first = sorted({slot[c] for c in dirty if c in slot})
        if not first:
            return 0
        norms = torch.empty(len(ids), dtype=torch.float64)
        rows = _Rows(self.units(ids, norms, scratch=True), norms, first)
        self._scratch = None  # the rows own it while they merge: a reading in on_merge gets other memory
        merges = 0
        while True:
            pair = rows.best_pair(ids, tau)
            if pair is None:
                self._scratch = rows.u  # back for the round's next readers
                return merges
            keep, gone, cos = pair
            if (leave_out > 0 and not self.leave_out_cosine(keep, gone, leave_out) > tau + EPS) or (
                quorum > 0 and not self.agreed(keep, gone, tau if quorum_tau is None else quorum_tau, quorum)
            ):
                rows.block(slot[keep], slot[gone])
                self.refused += 1
                continue
            if on_merge is not None:
                on_merge(keep, gone)
            if heights is not None:
                heights.append(cos)
            self._fold(keep, gone)
            merges += 1
            rows.merged(slot[keep], slot[gone], self.sums_[keep])

    def lookup(self, psi: torch.Tensor, tau: float) -> tuple[int, float, bool]:
        """Most similar cluster to ``psi`` (ties within EPS: the smallest id), the cosine, and
        whether it reaches tau (paper 4.4: joins when the cosine >= tau, at resolution EPS)."""
        ids, sims = self.similarities(psi)
        if not ids:
            return -1, float("nan"), False
        top = float(sims.max())
        k = int(torch.nonzero(sims >= top - EPS)[0])
        return ids[k], float(sims[k]), bool(float(sims[k]) >= tau - EPS)

    # ---- state ---------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        ids = self.ids
        # float64 where any cluster has two members or more; where every cluster is a singleton
        # (each sum a Psi as given, float32) they are kept as they are: half the checkpoint, and
        # every use of a sum widens it to float64 first, so the numbers are the same
        sums = [self.sums_[c] for c in ids]
        wide = any(t.dtype != torch.float32 for t in sums)
        tensors = {"cluster_sums": torch.stack([t.double() if wide else t for t in sums])} if ids else {}
        clients = sorted(self.vectors_)
        if clients:
            dtype = torch.float64 if any(v.dtype == torch.float64 for v in self.vectors_.values()) else torch.float32
            tensors["member_vectors"] = torch.stack([self.vectors_[i].to(dtype) for i in clients])
        return tensors, {
            "ids": ids,
            "counts": [self.counts_[c] for c in ids],
            "next_id": self.next_id,
            "labels": self.labels_.tolist(),
            "merged_at": self.merged_at,
            "vector_clients": clients,
        }

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self._scratch = None
        ids = meta["ids"]
        sums = tensors["cluster_sums"] if ids else torch.zeros(0)
        if sums.dtype != torch.float32:  # a singletons' float32 stack stays as written
            sums = sums.double()
        self.sums_ = {c: sums[k].clone() for k, c in enumerate(ids)}
        self.counts_ = dict(zip(ids, meta["counts"]))
        self.next_id = meta["next_id"]
        self.labels_ = np.asarray(meta["labels"], dtype=np.int64)
        self.members_ = {c: np.flatnonzero(self.labels_ == c).tolist() for c in ids}
        self.merged_at = meta.get("merged_at")
        clients = meta.get("vector_clients", [])
        self.vectors_ = {i: tensors["member_vectors"][k].clone() for k, i in enumerate(clients)}


class _Rows:
    """Cosines of the dirty clusters (rows) to every cluster (columns, by slot), each row's
    cached maximum, and the bookkeeping of a merge. ``sims`` holds what may merge: dead slots,
    a row's own slot and refused pairs hold -inf; ``cos`` holds the true cosines of the same
    rows, from which a merged cluster's row is formed."""

    def __init__(self, u: torch.Tensor, norms: torch.Tensor, first: list[int]):
        self.u = u
        self.norms = norms  # |S| of every slot
        k = len(u)
        self.dead = torch.zeros(k, dtype=torch.bool)
        cap = 2 * len(first)
        self.cos = torch.zeros((cap, k), dtype=torch.float64)
        self.sims = torch.full((cap, k), -np.inf, dtype=torch.float64)
        self.row_slot = torch.full((cap,), -1, dtype=torch.long)  # cluster slot of each row, -1 = none
        self.slot_row = torch.full((k,), -1, dtype=torch.long)
        self.best = torch.full((cap,), -np.inf, dtype=torch.float64)
        self.arg = torch.zeros(cap, dtype=torch.long)
        first_t = torch.tensor(first)
        n = len(first)
        self.cos[:n] = (u if n == k else u[first_t]) @ u.T  # all dirty (a first round): no copy of u
        self.sims[:n] = self.cos[:n]
        self.sims[torch.arange(n), first_t] = -np.inf
        self.row_slot[:n] = first_t
        self.slot_row[first_t] = torch.arange(n)
        self.n_rows = n
        self.best[:n], self.arg[:n] = self.sims[:n].max(dim=1)

    def _add_row(self, s: int) -> int:
        """A row for the clean cluster in slot ``s``: its true cosines, one pass over ``u``."""
        if self.n_rows == len(self.row_slot):  # grow: a merge can make an older cluster dirty
            cap = 2 * len(self.row_slot)
            grow = cap - len(self.row_slot)
            self.cos = torch.cat([self.cos, torch.zeros((grow, self.cos.shape[1]), dtype=torch.float64)])
            self.sims = torch.cat([self.sims, torch.full((grow, self.sims.shape[1]), -np.inf, dtype=torch.float64)])
            self.row_slot = torch.cat([self.row_slot, torch.full((grow,), -1, dtype=torch.long)])
            self.best = torch.cat([self.best, torch.full((grow,), -np.inf, dtype=torch.float64)])
            self.arg = torch.cat([self.arg, torch.zeros(grow, dtype=torch.long)])
        r = self.n_rows
        self.row_slot[r], self.slot_row[s] = s, r
        self.cos[r] = self.u @ self.u[s]
        self.n_rows += 1
        return r

    def best_pair(self, ids: list[int], tau: float) -> tuple[int, int, float] | None:
        """The pair to merge next as (older id, younger id, cosine), or None."""
        live = torch.nonzero(self.row_slot[: self.n_rows] >= 0).squeeze(1)
        if not len(live):
            return None
        top = float(self.best[live].max())
        if not top > tau + EPS:
            return None
        floor = max(top - EPS, tau + EPS)
        rows = live[self.best[live] >= floor]
        sub = self.sims[rows]
        idt = torch.as_tensor(ids)
        # in each candidate row a, the tied column with the smallest id b makes the row's
        # smallest pair (min(a, b), max(a, b)); then the smallest over the rows
        col_id = torch.where((sub >= floor) & (sub > tau + EPS), idt, len(ids) + max(ids) + 1)
        b, col = col_id.min(dim=1)
        a = idt[self.row_slot[rows]]
        lo, hi = torch.minimum(a, b), torch.maximum(a, b)
        j = int(torch.argmin(lo * (max(ids) + 1) + hi))
        return int(lo[j]), int(hi[j]), float(sub[j, col[j]])

    def block(self, sa: int, sb: int) -> None:
        """The pair in slots ``sa`` and ``sb`` may not merge (until one of them changes)."""
        for s, other in ((sa, sb), (sb, sa)):
            r = int(self.slot_row[s])
            if r >= 0:
                self.sims[r, other] = -np.inf
                self.best[r], self.arg[r] = self.sims[r].max(dim=0)

    def merged(self, ks: int, gs: int, sum_keep: torch.Tensor) -> None:
        """Cluster in slot ``gs`` was folded into slot ``ks`` (its sum now ``sum_keep``)."""
        kr = int(self.slot_row[ks]) if self.slot_row[ks] >= 0 else self._add_row(ks)
        gr = int(self.slot_row[gs]) if self.slot_row[gs] >= 0 else self._add_row(gs)
        n_new = sum_keep.norm()
        # u_j . (S_k + S_g) / |S_k + S_g| from the two rows; a sum of zero has no direction (cosine 0)
        new = (
            (self.norms[ks] * self.cos[kr] + self.norms[gs] * self.cos[gr]) / n_new
            if n_new > 0
            else torch.zeros_like(self.cos[kr])
        )
        self.norms[ks] = n_new
        self.dead[gs] = True
        torch.div(sum_keep.double(), n_new, out=self.u[ks]) if n_new > 0 else self.u[ks].zero_()
        self.cos[gr], self.sims[gr], self.best[gr], self.row_slot[gr], self.slot_row[gs] = 0.0, -np.inf, -np.inf, -1, -1
        live = torch.nonzero(self.row_slot[: self.n_rows] >= 0).squeeze(1)
        slots = self.row_slot[live]
        self.cos[kr] = new
        self.cos[live, ks] = new[slots]
        # the merged cluster's row, and its column in every dirty row
        row = new.clone()
        row[self.dead] = -np.inf
        row[ks] = -np.inf
        self.sims[kr] = row
        col = new[slots]
        col[slots == ks] = -np.inf
        self.sims[live, ks] = col
        self.sims[live, gs] = -np.inf
        # rows whose cached maximum was in a changed column are recomputed; the others only
        # compare with the new value in column ks
        stale = live[(self.arg[live] == ks) | (self.arg[live] == gs) | (live == kr)]
        if len(stale):
            self.best[stale], self.arg[stale] = self.sims[stale].max(dim=1)
        better = self.sims[live, ks] > self.best[live]
        self.best[live[better]] = self.sims[live[better], ks]
        self.arg[live[better]] = ks
