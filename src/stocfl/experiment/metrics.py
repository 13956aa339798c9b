"""Figures of a partition: clustering scores against the true groups, label cosines, cluster
numbers and the per-cluster table."""

from __future__ import annotations

from typing import Any

import numpy as np


def _placed(labels: np.ndarray, participants: list[int] | None) -> np.ndarray:
    """The clients placed (label >= 0) among the participants (held-out clients never count)."""
    placed = labels >= 0
    if participants is not None:
        placed &= np.isin(np.arange(len(labels)), participants)
    return placed


_SCORED: dict[tuple, dict[str, Any]] = {}  # the last partition scored: its inputs -> its scores


def clustering_scores(
    labels: np.ndarray,
    groups: np.ndarray | None,
    participants: list[int] | None = None,
    label_dists: np.ndarray | None = None,
) -> dict[str, Any]:
    """Over the participants placed so far (held-out clients never count): their number
    (``placed``) and share of all participants (``coverage``), the number of clusters among
    them, ARI and NMI against the true groups, and with ``label_dists`` (the clients' unit
    label histograms) :func:`label_cosines`, which needs no true groups.

    A run scores its partition every round, and most rounds leave it as it was (FedAvg's never
    changes): the scores of the same inputs as the last call's are that call's (a copy), where
    scikit-learn's two scores took several milliseconds a round."""
    key = tuple(
        None if a is None else (a.dtype.str, a.shape, a.tobytes())
        for a in (labels, groups, None if participants is None else np.asarray(participants), label_dists)
    )
    if key not in _SCORED:
        _SCORED.clear()
        _SCORED[key] = _clustering_scores(labels, groups, participants, label_dists)
    return dict(_SCORED[key])


def _clustering_scores(
    labels: np.ndarray,
    groups: np.ndarray | None,
    participants: list[int] | None,
    label_dists: np.ndarray | None,
) -> dict[str, Any]:
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    assigned = _placed(labels, participants)
    n = len(participants) if participants is not None else len(labels)
    out: dict[str, Any] = {
        "n_clusters": int(len(np.unique(labels[assigned]))),
        "placed": int(assigned.sum()),
        "coverage": float(assigned.sum() / n) if n else None,
        "ari": None,
        "nmi": None,
    }
    if groups is not None and assigned.any():
        out["ari"] = float(adjusted_rand_score(groups[assigned], labels[assigned]))
        out["nmi"] = float(normalized_mutual_info_score(groups[assigned], labels[assigned]))
    if label_dists is not None:
        out.update(label_cosines(label_dists[assigned], labels[assigned]))
    return out


def mixture_distance(
    labels: np.ndarray, weights: np.ndarray | None, mixtures: np.ndarray, participants: list[int] | None = None
) -> float | None:
    """The mean total-variation distance between each placed participant's found weights over
    the clusters (``weights``, N x K; None: wholly in its ``labels`` cluster) and its true
    mixture over the groups (``mixtures``, N x G): 0 when every client's found shares are its
    true ones, 1 when they never overlap. Found clusters are named by the true groups first:
    cluster k stands for the group whose shares over the clients are most like its weights
    (the cosine of the columns w_k and m_g over the placed clients; among equals, the group
    it holds most weight of, sum_i w_ik m_ig), and
    the weights of clusters that stand for one group add up, so a group split in two costs
    nothing and two groups merged in one cluster cost their smaller share. None while no
    participant is placed."""
    placed = _placed(labels, participants)
    if not placed.any():
        return None
    if weights is None:
        ids, found = np.unique(labels[placed], return_inverse=True)
        w = np.zeros((int(placed.sum()), len(ids)))
        w[np.arange(len(found)), found] = 1.0
    else:
        w = np.nan_to_num(np.asarray(weights, dtype=np.float64)[placed])
    m = np.asarray(mixtures, dtype=np.float64)[placed]
    mass = w.T @ m
    norms = np.linalg.norm(w, axis=0)[:, None] * np.linalg.norm(m, axis=0)[None, :]
    cosine = np.divide(mass, norms, out=np.zeros_like(mass), where=norms > 0)
    # cluster -> group: the most alike; among equally alike (one client: every cosine is 1),
    # the group it holds most weight of
    best = cosine >= cosine.max(1, keepdims=True) - 1e-12
    stands_for = np.where(best, mass, -np.inf).argmax(1)
    named = np.zeros_like(m)
    for k, g in enumerate(stands_for):
        named[:, g] += w[:, k]
    return float(0.5 * np.abs(named - m).sum(1).mean())


def label_cosines(dists: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
    """How far a partition follows the clients' labels, with no true groups needed: the mean
    cosine between the label distributions (unit rows of ``dists``) of two clients in one
    cluster (``label_cos_within``) and of any two clients (``label_cos_all``); None where there
    is no such pair. A partition that ignores the labels has within = all. Computed from
    per-cluster sums (sum over pairs i != j of u_i.u_j = |sum u|^2 - sum |u|^2), O(N C), so
    it runs every round at any N."""
    n = len(labels)
    if n < 2:
        return {"label_cos_within": None, "label_cos_all": None}
    dists = np.asarray(dists, dtype=np.float64)
    self_dots = float(np.einsum("ij,ij->", dists, dists))
    total = dists.sum(axis=0)
    _, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    sums = np.zeros((len(sizes), dists.shape[1]))
    np.add.at(sums, inverse, dists)
    pairs_within = float((sizes * (sizes - 1)).sum())
    within = (float(np.einsum("ij,ij->", sums, sums)) - self_dots) / pairs_within if pairs_within else None
    return {"label_cos_within": within, "label_cos_all": (float(total @ total) - self_dots) / (n * (n - 1))}


def cluster_numbers(labels: np.ndarray, ids=()) -> dict[int, int]:
    """Internal cluster id -> the number a reader sees: 0..K-1, clusters ordered by their
    lowest-numbered member, so that one partition is numbered alike whatever algorithm found it;
    then the ``ids`` that have no member (a model no client chose), in id order."""
    found, first = np.unique(labels[labels >= 0], return_index=True)
    first = np.flatnonzero(labels >= 0)[first]
    number = {int(found[j]): n for n, j in enumerate(np.argsort(first, kind="stable"))}
    for k in sorted(int(k) for k in ids if int(k) not in number):
        number[k] = len(number)
    return number


def cluster_table(labels: np.ndarray, groups: np.ndarray | None, evals: dict) -> list[dict[str, Any]]:
    """Per found cluster (numbered by :func:`cluster_numbers`, the algorithm's own id beside):
    members, the mix of true groups as ``group:count`` pairs, accuracy of its members (own model)."""
    rows = []
    for k, number in sorted(cluster_numbers(labels).items(), key=lambda kv: kv[1]):
        members = np.flatnonzero(labels == k)
        res = [evals[i] for i in members if i in evals]
        n = sum(r.n_samples for r in res)
        row = {
            "cluster": number,
            "id": k,
            "members": len(members),
            "accuracy": sum(r.correct for r in res) / n if n else None,
        }
        if groups is not None:
            mix = np.bincount(groups[members], minlength=int(groups.max()) + 1)
            row["true_groups"] = " ".join(f"{g}:{c}" for g, c in enumerate(mix) if c)
        rows.append(row)
    return rows


def group_cluster_share(clients: list[int], labels: np.ndarray, groups: np.ndarray, among: list[int]) -> float | None:
    """The share of ``clients`` in their true group's cluster: the cluster that holds most of
    that group's placed clients of ``among`` (ties: the lower cluster id). A client not placed,
    or in a cluster its group does not mostly hold (a singleton of its own, say), is not in it.
    None for no clients."""
    if not clients:
        return None
    ids = np.asarray(among, dtype=np.int64)
    ids = ids[labels[ids] >= 0]
    home: dict[int, int] = {}
    for g in np.unique(groups[ids]):
        found, counts = np.unique(labels[ids[groups[ids] == g]], return_counts=True)
        home[int(g)] = int(found[counts.argmax()])
    return float(np.mean([labels[i] >= 0 and home.get(int(groups[i])) == int(labels[i]) for i in clients]))


def arrivals(
    labels: np.ndarray, groups: np.ndarray | None, present: list[int], joined: list[int], left: list[int]
) -> dict[str, Any]:
    """A round of a federation with a schedule: how many clients are present, who joined and
    who left at its start, the share of the joined ones placed by the round's end and, with
    true groups, the share in their group's cluster (:func:`group_cluster_share`)."""
    out: dict[str, Any] = {"present": len(present), "joined": list(joined), "left": list(left)}
    if joined:
        out["joined_placed"] = float(np.mean(labels[joined] >= 0))
        if groups is not None:
            out["joined_in_group"] = group_cluster_share(joined, labels, groups, present)
    return out


def cohort_accuracy(evals: dict, drift) -> dict[str, float | None]:
    """Accuracy pooled over samples of each drift cohort (:attr:`~stocfl.data.drift.Drift.cohorts`) among the
    clients evaluated, each on the data it holds in the round: ``accuracy_drift_<r>`` for the
    clients that change at round r, ``accuracy_steady`` for those that never change (None: none
    of them evaluated)."""
    out = {}
    for key, clients in drift.cohorts.items():
        res = [evals[i] for i in clients if i in evals]
        n = sum(r.n_samples for r in res)
        out["accuracy_steady" if key == "steady" else f"accuracy_drift_{key}"] = (
            sum(r.correct for r in res) / n if n else None
        )
    return out


def recovery(rows: list[dict[str, Any]], key: str, change: int, until: int | None, tolerance: float) -> dict:
    """How a cohort's accuracy (``key`` in the rows) came through the change at round
    ``change``: its level in the last evaluated round before it (``before``), in the round of
    the change (after that round's training, ``at_change``), the lowest until the next change
    (``until``, exclusive; None: the end), and ``recovered_in``: the rounds after ``change``
    until it is back within ``tolerance`` of ``before`` (0: it never fell below that; None: not
    by ``until`` or the end)."""
    before = [r[key] for r in rows if r["round"] < change and r.get(key) is not None]
    after = [(r["round"], r.get(key)) for r in rows if r["round"] >= change and (until is None or r["round"] < until)]
    after = [(t, v) for t, v in after if v is not None]
    out: dict[str, Any] = {"before": before[-1] if before else None, "at_change": None, "lowest": None}
    out["recovered_in"] = None
    if not after:
        return out
    out["at_change"] = after[0][1] if after[0][0] == change else None
    out["lowest"] = min(v for _, v in after)
    if out["before"] is not None:
        back = next((t for t, v in after if v >= out["before"] - tolerance), None)
        out["recovered_in"] = None if back is None else back - change
    return out
