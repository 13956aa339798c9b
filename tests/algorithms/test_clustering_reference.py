"""The incremental clustering (``ClusterSet``) against a brute-force reference, on generated
inputs: dimensions, group structures, exact ties, cosines at and near tau, thresholds that
change between rounds, and sequences of newcomer batches.

The reference recomputes every centroid from its members' representations and every pairwise
cosine after each merge, and applies the rule of ``stocfl.algorithms.stocfl.clustering`` literally. The fast
profile runs in the suite; ``HYPOTHESIS_PROFILE=long`` runs thousands of examples.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stocfl.algorithms.stocfl.clustering import EPS, ClusterSet


class Reference:
    """Greedy centroid linkage recomputed from scratch after every merge."""

    def __init__(self, n: int):
        self.psi: dict[int, torch.Tensor] = {}
        self.clusters: dict[int, list[int]] = {}
        self.next_id = 0
        self.n = n
        self.blocked: set[tuple[int, int]] = set()  # pairs the merge check refused, until either changes
        self.last_tau: float | None = None

    def add(self, client: int, psi: torch.Tensor) -> None:
        self.psi[client] = psi.double()
        self.clusters[self.next_id] = [client]
        self.next_id += 1

    def centroid(self, cid: int) -> torch.Tensor:
        s = torch.zeros_like(next(iter(self.psi.values())))
        for i in self.clusters[cid]:
            s = s + self.psi[i]
        return s / s.norm() if s.norm() > 0 else s

    def total(self, members) -> torch.Tensor:
        s = torch.zeros_like(next(iter(self.psi.values())))
        for i in members:
            s = s + self.psi[i]
        return s

    def cos(self, ma, mb) -> float:
        a, b = self.total(ma), self.total(mb)
        return float(a @ b / (a.norm() * b.norm())) if a.norm() > 0 and b.norm() > 0 else -2.0

    def leave_out_cosine(self, a: int, b: int, fraction: float) -> float:
        """Each member's removal tried on its own, then the r most influential removed at once."""
        side = {i: 0 for i in self.clusters[a]} | {i: 1 for i in self.clusters[b]}
        r = max(1, int(fraction * len(side)))
        ranked = []
        for i, sd in side.items():
            own = self.clusters[a] if sd == 0 else self.clusters[b]
            if len(own) > 1:
                rest = [j for j in own if j != i]
                ranked.append((self.cos(rest, self.clusters[b]) if sd == 0 else self.cos(self.clusters[a], rest), i))
        gone: list[int] = []
        for _, i in sorted(ranked):
            own = self.clusters[a] if side[i] == 0 else self.clusters[b]
            if len(gone) < r and sum(side[j] == side[i] for j in gone) < len(own) - 1:
                gone.append(i)
        return self.cos([i for i in self.clusters[a] if i not in gone], [i for i in self.clusters[b] if i not in gone])

    def agreed(self, a: int, b: int, tau: float, quorum: float) -> bool:
        """Each member's own cosine to the other cluster's centroid, counted per side."""
        for own, other in ((a, b), (b, a)):
            if len(self.clusters[own]) < 2:
                continue
            c = self.centroid(other)
            yes = sum(float(self.psi[i] @ c / self.psi[i].norm()) > tau + EPS for i in self.clusters[own])
            if not yes > quorum * len(self.clusters[own]):
                return False
        return True

    def merge(self, tau: float, leave_out: float = 0.0, quorum: float = 0.0, quorum_tau=None) -> int:
        if tau != self.last_tau:
            self.blocked.clear()
        self.last_tau = tau
        merges = 0
        while len(self.clusters) > 1:
            ids = sorted(self.clusters)
            cent = {c: self.centroid(c) for c in ids}
            cos = {
                (a, b): float(torch.dot(cent[a], cent[b]))
                for ia, a in enumerate(ids)
                for b in ids[ia + 1 :]
                if (a, b) not in self.blocked
            }
            if not cos:
                break
            top = max(cos.values())
            if not top > tau + EPS:
                break
            floor = max(top - EPS, tau + EPS)
            a, b = min(p for p, c in cos.items() if c >= floor and c > tau + EPS)
            if (leave_out > 0 and not self.leave_out_cosine(a, b, leave_out) > tau + EPS) or (
                quorum > 0 and not self.agreed(a, b, tau if quorum_tau is None else quorum_tau, quorum)
            ):
                self.blocked.add((a, b))
                continue
            self.clusters[a] += self.clusters.pop(b)
            self.blocked = {p for p in self.blocked if a not in p and b not in p}
            merges += 1
        return merges

    def labels(self) -> np.ndarray:
        out = np.full(self.n, -1, dtype=np.int64)
        for c, members in self.clusters.items():
            out[members] = c
        return out

    def lookup(self, psi: torch.Tensor, tau: float) -> tuple[int, bool]:
        p = psi.double() / psi.double().norm()
        sims = {c: float(torch.dot(self.centroid(c), p)) for c in sorted(self.clusters)}
        top = max(sims.values())
        k = min(c for c, s in sims.items() if s >= top - EPS)
        return k, sims[k] >= tau - EPS


def _with_cosine(e: torch.Tensor, c: float, g: torch.Generator) -> torch.Tensor:
    """A unit vector whose cosine with the unit vector ``e`` is ``c``."""
    f = torch.randn(len(e), generator=g, dtype=torch.float64)
    f = f - (f @ e) * e
    if f.norm() < 1e-6:
        return e.clone()
    f = f / f.norm()
    return c * e + math.sqrt(max(0.0, 1 - c * c)) * f


OFFSETS = (0.0, 1e-6, -1e-6, 1e-4, -1e-4, 0.01, -0.01, 0.1, -0.1)


@st.composite
def scenarios(draw):
    """Representations of a run, its newcomer batches, and one tau per round."""
    lattice = draw(st.booleans())  # small integer vectors: many exact ties that do not commute
    dim = draw(st.integers(2, 3)) if lattice else draw(st.integers(2, 12))
    n = draw(st.integers(1, 28))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    taus = st.one_of(st.sampled_from([-1.0, 0.0, 0.5, 1.0, 0.7071067811865476, 0.3162277660168379]), st.floats(-1, 1))
    tau0 = draw(taus)
    n_groups = draw(st.integers(1, 5))
    centers = torch.randn(n_groups, dim, generator=g, dtype=torch.float64)
    centers = centers / centers.norm(dim=1, keepdim=True)
    psis: list[torch.Tensor] = []
    for i in range(n):
        kind = "integer" if lattice else draw(st.sampled_from(["group", "copy", "near_tau", "integer", "random"]))
        if kind == "copy" and psis:
            v = psis[draw(st.integers(0, len(psis) - 1))].clone()  # exact ties
        elif kind == "near_tau":
            ref = psis[draw(st.integers(0, len(psis) - 1))] if psis else centers[0]
            ref = ref / ref.norm()
            v = _with_cosine(ref, min(1.0, max(-1.0, tau0 + draw(st.sampled_from(OFFSETS)))), g)
        elif kind == "integer":
            v = torch.tensor(
                draw(st.lists(st.integers(-1 if lattice else -2, 2), min_size=dim, max_size=dim)), dtype=torch.float64
            )
        elif kind == "random":
            v = torch.randn(dim, generator=g, dtype=torch.float64)
        else:
            noise = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
            v = centers[draw(st.integers(0, n_groups - 1))] + noise * torch.randn(dim, generator=g, dtype=torch.float64)
        if float(v.norm()) == 0.0:
            v = torch.ones(dim, dtype=torch.float64)
        psis.append(v * draw(st.sampled_from([1.0, 3.0, 0.01])))  # the scale must not matter
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n - 1)), max_size=5)))) if n > 1 else []
    batches = [list(range(a, b)) for a, b in zip([0, *cuts], [*cuts, n]) if b > a]
    same_tau = draw(st.booleans())
    round_taus = [tau0 if same_tau else (tau0 if k == 0 else draw(taus)) for k in range(len(batches))]
    return psis, batches, round_taus


def _check_round(cs: ClusterSet, ref: Reference, merges: int, ref_merges: int, tau: float) -> None:
    assert np.array_equal(cs.labels_, ref.labels()), (cs.labels_, ref.labels())
    assert merges == ref_merges
    u = cs.units(cs.ids)
    if len(u) > 1:
        sims = u @ u.T - 4 * torch.eye(len(u), dtype=torch.float64)
        assert float(sims.max()) <= tau + EPS + 1e-12, "a pair above tau survived the round"
    for c in cs.ids:
        assert cs.counts_[c] == len(ref.clusters[c]) == len(cs.members_[c])


def replay(case, reload_between_rounds=False, leave_out=0.0, quorum=0.0, quorum_tau=None):
    """Both implementations through the case's rounds; yields after each round (the
    incremental set, the reference, both merge counts, tau, and the incremental (keep, gone)
    pairs). Odd clients send float32 representations, as clients do; even ones float64."""
    psis, batches, taus = case
    n = len(psis)
    keep = leave_out > 0 or quorum > 0
    cs, ref = ClusterSet(n, keep_vectors=keep), Reference(n)
    for batch, tau in zip(batches, taus):
        if reload_between_rounds:  # the checkpoint's round trip between rounds
            tensors, meta = cs.state()
            cs = ClusterSet(n, keep_vectors=keep)
            cs.load_state(tensors, meta)
        sent = {i: psis[i].float() if i % 2 else psis[i] for i in batch}
        new = [cs.add(i, sent[i]) for i in batch]
        for i in batch:
            ref.add(i, sent[i])
        merged: list[tuple[int, int]] = []
        merges = cs.merge_greedy(
            new,
            tau,
            on_merge=lambda keep, gone: merged.append((keep, gone)),
            leave_out=leave_out,
            quorum=quorum,
            quorum_tau=quorum_tau,
        )
        yield cs, ref, merges, ref.merge(tau, leave_out, quorum, quorum_tau), tau, merged


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.booleans())
def test_incremental_clustering_equals_brute_force(case, reload_between_rounds):
    for cs, ref, merges, ref_merges, tau, merged in replay(case, reload_between_rounds):
        _check_round(cs, ref, merges, ref_merges, tau)
        assert all(keep < gone for keep, gone in merged), "the older cluster id is kept"


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.booleans(), st.sampled_from([0.01, 0.1, 0.25, 0.45]))
def test_merge_check_equals_brute_force(case, reload_between_rounds, leave_out):
    """The merge check (leave out the most influential members) and its blocked pairs, against
    a reference that recomputes every leave-one-out centroid from the members' vectors."""
    for cs, ref, merges, ref_merges, tau, merged in replay(case, reload_between_rounds, leave_out):
        assert np.array_equal(cs.labels_, ref.labels()), (cs.labels_, ref.labels())
        assert merges == ref_merges and cs.refused >= 0
        for c in cs.ids:
            assert cs.counts_[c] == len(ref.clusters[c]) == len(cs.members_[c])


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.booleans(), st.sampled_from([0.1, 0.5, 0.75]), st.sampled_from([None, -0.2, 0.35, 0.9]))
def test_members_quorum_equals_brute_force(case, reload_between_rounds, quorum, quorum_tau):
    """The members' quorum and its blocked pairs, against a reference that computes every
    member's cosine to the other cluster's centroid from the members' vectors."""
    for cs, ref, merges, ref_merges, tau, merged in replay(
        case, reload_between_rounds, quorum=quorum, quorum_tau=quorum_tau
    ):
        assert np.array_equal(cs.labels_, ref.labels()), (cs.labels_, ref.labels())
        assert merges == ref_merges and cs.refused >= 0
        for c in cs.ids:
            assert cs.counts_[c] == len(ref.clusters[c]) == len(cs.members_[c])


@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.data())
def test_new_client_lookup_equals_brute_force(case, data):
    psis, _, taus = case
    for cs, ref, *_ in replay(case):
        pass
    tau = taus[-1]
    before = cs.labels_.copy()
    other = torch.randn(len(psis[0]), generator=torch.Generator().manual_seed(len(psis)), dtype=torch.float64)
    for q in (psis[data.draw(st.integers(0, len(psis) - 1))], -psis[0], other):
        k, cos, joins = cs.lookup(q, tau)
        rk, rjoins = ref.lookup(q, tau)
        assert (k, joins) == (rk, rjoins)
        assert cos == pytest.approx(float(cs.unit(k) @ (q.double() / q.double().norm())), abs=1e-12)
    assert np.array_equal(cs.labels_, before), "a lookup never changes the partition"


def test_a_newcomer_bridging_older_clusters_does_not_overflow():
    """Defect 1 of issue 11: the newcomer (id 3) merges with cluster 2, the result with 1, then
    with 0; each merge keeps an older cluster that had no row yet. The old fixed buffer of
    2 * dirty + 1 rows overflowed here with an IndexError."""
    e = torch.eye(4, dtype=torch.float64)
    # three older clusters, pairwise cos 0 (below tau), a newcomer close to all of them
    old = [e[0] + 0.3 * e[3], e[1] + 0.2 * e[3], e[2] + 0.1 * e[3]]
    cs = ClusterSet(5)
    cs.merge_greedy([cs.add(i, v) for i, v in enumerate(old)], 0.3)
    assert len(cs) == 3
    bridge = e[0] + e[1] + e[2] + 0.05 * e[3]
    ref = Reference(5)
    for i, v in enumerate(old):
        ref.add(i, v)
    ref.merge(0.3)
    ref.add(3, bridge)
    merges = cs.merge_greedy([cs.add(3, bridge)], 0.3)
    assert merges == ref.merge(0.3) == 3
    assert np.array_equal(cs.labels_, ref.labels()) and len(cs) == 1


def test_ties_merge_the_pair_with_the_smallest_ids():
    """a = (1, 0) is equally close to b = (1, 1) and c = (1, -1) (cos 0.707); merging a with b
    leaves c apart at tau = 0.5, merging a with c would leave b apart: the rule picks (a, b)."""
    cs = ClusterSet(3)
    vs = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])]
    assert cs.merge_greedy([cs.add(i, v) for i, v in enumerate(vs)], 0.5) == 1
    assert cs.labels_.tolist() == [0, 0, 2]
    cs = ClusterSet(3)  # the same vectors arriving in another order: ids follow arrival
    order = [2, 0, 1]
    assert cs.merge_greedy([cs.add(i, vs[i]) for i in order], 0.5) == 1
    assert cs.labels_.tolist() == [0, 2, 0]  # c (id 0) - a (id 1) ties with a - b (1, 2): (0, 1) first


def test_rejects_non_finite_or_zero_representations():
    cs = ClusterSet(3)
    for bad in (torch.zeros(4), torch.tensor([1.0, float("nan"), 0, 0]), torch.tensor([float("inf"), 0, 0, 0])):
        with pytest.raises(ValueError, match="finite, non-zero"):
            cs.add(0, bad)
    cs.add(0, torch.ones(4))
    with pytest.raises(ValueError, match="already"):
        cs.add(0, torch.ones(4))


def test_singletons_keep_psi_as_given_and_merges_never_modify_it():
    """A newcomer's Psi is held without a float64 copy until it merges (the paper's Psi of a
    1.6M-parameter model: 6.5 MB each instead of 13), and folding makes a new float64 sum."""
    g = torch.Generator().manual_seed(0)
    psis = [torch.randn(64, generator=g) for _ in range(6)]
    psis[1] = psis[0] + 0.01 * psis[1]  # 0 and 1 merge
    kept = [p.clone() for p in psis]
    cs = ClusterSet(6)
    ids = [cs.add(i, p) for i, p in enumerate(psis)]
    assert all(cs.sums_[c].data_ptr() == p.data_ptr() for c, p in zip(ids, psis))  # no copy
    assert cs.merge_greedy(ids, 0.5) >= 1
    assert all(torch.equal(p, k) for p, k in zip(psis, kept))
    merged = cs.labels_[0]
    assert cs.sums_[merged].dtype == torch.float64
    assert torch.equal(cs.sums_[merged], kept[0].double() + kept[1].double())


@pytest.mark.long
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios(), st.sampled_from([2, 3, 20]))
def test_tau_cuts_count_the_clusters_a_merge_at_their_tau_leaves(case, max_clusters):
    """Each cut of the tau helper says how many clusters merging at its tau leaves: checked
    against the reference merged from scratch at that tau."""
    from stocfl.algorithms.stocfl.tau import merge_heights, suggest_tau, tau_cuts

    psis = case[0]
    if len(psis) < 3:
        return
    reps = torch.stack([p / p.norm() for p in psis])
    cuts = tau_cuts(reps, max_clusters)
    h = sorted(merge_heights(reps), reverse=True)
    assert len(cuts) == min(len(h) - 1, max_clusters - 1)
    assert [c.gap for c in cuts] == sorted((c.gap for c in cuts), reverse=True)
    assert suggest_tau(reps, max_clusters) == cuts[0].tau
    for cut in cuts:
        ref = Reference(len(psis))
        for i, p in enumerate(reps):
            ref.add(i, p)
        ref.merge(cut.tau, 0.0)
        assert cut.clusters == len(ref.clusters), (cut, h)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(2, 30),
    dim=st.integers(1, 40),
    groups=st.integers(1, 4),
    tau=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**16),
)
def test_units_read_from_kept_memory_are_the_fresh_ones_even_when_a_merge_callback_reads_them(
    k, dim, groups, tau, seed
):
    """A round's readers of the units share memory the set keeps (the merge's rows, the
    untrained clusters' models, the objective): each reading is the fresh computation to the
    bit, and a reader inside the merge's callback gets its own memory, not the merge's rows."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(groups, dim, generator=g)
    psi = [centers[i % groups] + 0.3 * torch.randn(dim, generator=g) for i in range(k)]

    def clustered(read_in_callback: bool) -> tuple[np.ndarray, float, list[torch.Tensor]]:
        cs = ClusterSet(k)
        seen: list[torch.Tensor] = []

        def on_merge(keep: int, gone: int) -> None:
            if read_in_callback:  # as an algorithm's callback might: a reading while the merge runs
                seen.append(cs.units(cs.ids, scratch=True).clone())

        # two rounds: in the second only the newcomers are dirty, and a merge with an older,
        # clean cluster reads that cluster's unit from the merge's rows
        half = k // 2
        for i in range(half):
            cs.add(i, psi[i])
        cs.merge_greedy(cs.ids, tau, on_merge)
        fresh_ids = [cs.add(i, psi[i]) for i in range(half, k)]
        cs.merge_greedy(fresh_ids, tau, on_merge)
        ids = cs.ids
        plain = torch.stack([cs.sums_[c].double() / cs.sums_[c].double().norm() for c in ids])
        assert torch.equal(cs.units(ids, scratch=True), plain)
        assert torch.equal(cs.units(ids[: max(1, len(ids) // 2)], scratch=True), plain[: max(1, len(ids) // 2)])
        objective = cs.objective()
        fresh = cs.units(ids)
        total = fresh.sum(0).pow(2).sum()
        assert objective == (0.0 if len(ids) < 2 else float((total - fresh.mul_(fresh).sum()) / 2))
        cs.release_scratch()
        return cs.labels_.copy(), objective, seen

    labels, objective, _ = clustered(False)
    labels_read, objective_read, seen = clustered(True)
    assert np.array_equal(labels, labels_read) and objective == objective_read
