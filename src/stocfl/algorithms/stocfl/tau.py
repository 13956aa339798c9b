"""A tau helper (the StoCFL paper leaves choosing tau open).

Agglomerate the representations seen so far all the way down (tau = -1) with the same greedy
centroid linkage that StoCFL uses and record the cosine of each merge. Merges inside true
groups happen at high cosine, merges of two different groups at clearly lower cosine, and
there are at most ``max_clusters - 1`` of the latter. Sorting the merge cosines, the
suggestion is the middle of the widest gap that leaves at most ``max_clusters - 1`` merges
below it. Two gaps can be nearly as wide (two groups that are alike merge between the merges
inside groups and those across them): ``tau_cuts`` lists every cut, widest first, with the
number of clusters each leaves, so a caller can say what the runner-up would give.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stocfl.algorithms.stocfl.clustering import EPS, ClusterSet


def merge_heights(reps: torch.Tensor) -> list[float]:
    """Cosines of the successive greedy centroid-linkage merges of ``reps`` (n, d)."""
    cs = ClusterSet(len(reps))
    new = [cs.add(i, r) for i, r in enumerate(reps)]
    heights: list[float] = []
    cs.merge_greedy(new, -2.0, heights=heights)
    return heights


@dataclass(frozen=True)
class Cut:
    """tau in the middle of a gap between two successive merge cosines."""

    tau: float
    gap: float  # the gap's width
    clusters: int  # clusters left by merging the representations at this tau


def tau_cuts(reps: torch.Tensor, max_clusters: int = 20) -> list[Cut]:
    """Every cut of the merge heights of ``reps`` (n, d), n >= 3, that leaves at most
    ``max_clusters - 1`` merges below it: widest gap first (equal widths: the higher tau)."""
    if len(reps) < 3:
        raise ValueError(f"the tau helper needs at least 3 representations, got {len(reps)}")
    merged = merge_heights(reps)  # in merge order: merging at tau stops at the first not over it
    h = np.sort(np.asarray(merged))[::-1]  # descending
    lowest_cut = max(1, len(h) - (max_clusters - 1))  # at most max_clusters - 1 merges below tau
    cuts = []
    for j in range(lowest_cut - 1, len(h) - 1):
        tau = float(np.round((h[j] + h[j + 1]) / 2, 3))
        done = next((k for k, c in enumerate(merged) if not c > tau + EPS), len(merged))
        cuts.append(Cut(tau, float(h[j] - h[j + 1]), len(reps) - done))
    return sorted(cuts, key=lambda c: -c.gap)  # stable: among equal gaps the higher tau first


def suggest_tau(reps: torch.Tensor, max_clusters: int = 20) -> float:
    """Suggested tau for representations ``reps`` (n, d), n >= 3: the widest cut's."""
    return tau_cuts(reps, max_clusters)[0].tau
