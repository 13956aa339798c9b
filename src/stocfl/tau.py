"""A tau helper (the StoCFL paper leaves choosing tau open).

Agglomerate the representations seen so far all the way down (tau = -1) with the same greedy
centroid linkage that StoCFL uses and record the cosine of each merge. Merges inside true
groups happen at high cosine, merges of two different groups at clearly lower cosine, and
there are at most ``max_clusters - 1`` of the latter. Sorting the merge cosines, the
suggestion is the middle of the widest gap that leaves at most ``max_clusters - 1`` merges
below it.
"""

from __future__ import annotations

import numpy as np
import torch

from stocfl.clustering import ClusterSet


def merge_heights(reps: torch.Tensor) -> list[float]:
    """Cosines of the successive greedy centroid-linkage merges of ``reps`` (n, d)."""
    cs = ClusterSet(len(reps))
    new = [cs.add(i, r) for i, r in enumerate(reps)]
    heights: list[float] = []
    cs.merge_greedy(new, -2.0, heights=heights)
    return heights


def suggest_tau(reps: torch.Tensor, max_clusters: int = 20) -> float:
    """Suggested tau for representations ``reps`` (n, d), n >= 3."""
    if len(reps) < 3:
        raise ValueError(f"the tau helper needs at least 3 representations, got {len(reps)}")
    h = np.sort(np.asarray(merge_heights(reps)))[::-1]  # descending
    lowest_cut = max(1, len(h) - (max_clusters - 1))  # at most max_clusters - 1 merges below tau
    gaps = h[lowest_cut - 1 : -1] - h[lowest_cut:]
    j = lowest_cut - 1 + int(np.argmax(gaps))
    return float(np.round((h[j] + h[j + 1]) / 2, 3))
