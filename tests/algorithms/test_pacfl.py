"""PACFL against plain references: each label's basis against numpy's SVD, the proximity
matrix against a loop over pairs of vectors, the tree against the authors' merge loop; and the
method on rotated digits (finds the rotations, places new clients)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from sklearn.metrics import adjusted_rand_score

from stocfl.algorithms import PACFL
from stocfl.algorithms.pacfl import cut_tree, proximity
from stocfl.client.subspace import label_bases
from stocfl.executors import SequentialExecutor
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


def test_each_labels_basis_spans_numpys_first_singular_vectors():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand((30, 2, 3, 3), generator=g), torch.tensor([0] * 12 + [2] * 16 + [5] * 2)
    rows = label_bases(x, y, 3).numpy()
    assert rows.shape == (3 + 3 + 2, 18)
    start = 0
    for label, k in ((0, 3), (2, 3), (5, 2)):
        u = np.linalg.svd(x[y == label].reshape(-1, 18).double().numpy().T, full_matrices=False)[0][:, :k]
        mine = rows[start : start + k].T
        assert np.allclose(mine @ mine.T, u @ u.T, atol=1e-10)  # the same subspace, signs aside
        assert np.allclose(np.linalg.norm(mine, axis=0), 1.0)
        start += k


def plain_proximity(a, b):
    out = np.zeros((len(a), len(b)))
    for i, u in enumerate(a):
        for j, v in enumerate(b):
            best = max(abs(float(np.dot(p, q))) for p in u.numpy() for q in v.numpy())
            out[i, j] = np.degrees(np.arccos(min(1.0, best)))
    return out


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5), d=st.integers(2, 6))
def test_the_proximity_matrix_equals_the_loop_over_vector_pairs(seed, sizes, d):
    g = torch.Generator().manual_seed(seed)
    bases = [torch.nn.functional.normalize(torch.randn((k, d), generator=g, dtype=torch.float64), dim=1) for k in sizes]
    assert np.allclose(proximity(bases), plain_proximity(bases, bases), atol=1e-6)
    assert np.allclose(proximity(bases[:1], bases), plain_proximity(bases[:1], bases), atol=1e-6)
    flipped = [-b for b in bases]  # a singular vector's sign is arbitrary: the angle is between lines
    assert np.allclose(proximity(bases, flipped), proximity(bases), atol=1e-9)


def authors_tree(a, thresh, linkage):
    """The authors' loop (their hierarchical_clustering): merge the closest pair while it is
    within thresh; the merged row is the two rows' max, min or mean."""
    a = a.copy()
    groups = [[i] for i in range(len(a))]
    while len(a) > 1:
        np.fill_diagonal(a, np.inf)
        i, j = np.unravel_index(np.argmin(a), a.shape)
        if a[i, j] > thresh:
            break
        np.fill_diagonal(a, 0)
        z = {"complete": np.maximum, "single": np.minimum}.get(linkage, lambda p, q: (p + q) / 2)(a[:, i], a[:, j])
        a[:, i] = a[i, :] = z
        a = np.delete(np.delete(a, j, 0), j, 1)
        groups[i] += groups.pop(j)
    labels = np.zeros(sum(len(g) for g in groups), dtype=np.int64)
    for k, g in enumerate(sorted(groups, key=min)):
        labels[g] = k
    return labels


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 9),
    thresh=st.floats(0, 60),
    linkage=st.sampled_from(["average", "complete", "single"]),
)
def test_the_tree_equals_the_authors_merge_loop(seed, n, thresh, linkage):
    pts = np.random.default_rng(seed).uniform(0, 40, (n, 2))
    a = np.linalg.norm(pts[:, None] - pts[None], axis=2)
    assume(len(np.unique(np.round(a[np.triu_indices(n, 1)], 9))) == n * (n - 1) // 2)  # no ties
    assert np.array_equal(cut_tree(a, linkage, thresh, 0), authors_tree(a, thresh, linkage))


def test_pacfl_finds_the_rotations_of_the_digits_and_places_new_clients():
    cfg = configure.load(overrides=["algorithm.name=pacfl", "scenario.holdout=0.25"])
    exp = Experiment(cfg, None)
    fed, ex = exp.fed, SequentialExecutor(exp.fed, exp.model)
    alg = exp.algorithm
    assert isinstance(alg, PACFL)
    alg.round(1, fed.participants[:4], ex.execute)
    groups = np.asarray(fed.groups)
    labels = alg.cluster_labels()
    parts = fed.participants
    assert adjusted_rand_score(groups[parts], labels[parts]) > 0.9
    new = fed.heldout_clients
    placed = alg.place_new(new, ex.execute)
    # a new client lands in the cluster most of its rotation's participants are in
    majority = {g: np.bincount(labels[parts][groups[parts] == g]).argmax() for g in np.unique(groups)}
    hits = [p.cluster == majority[groups[p.client]] for p in placed]
    assert len(new) >= 5 and len(placed) == len(new) and np.mean(hits) >= 0.8


def test_a_threshold_and_a_cluster_count_together_are_refused():
    with pytest.raises(ValidationError, match="one of threshold and n_clusters"):
        PACFL.Params(threshold=5.0, n_clusters=3)
    assert PACFL.Params().threshold == 15.0 and PACFL.Params(n_clusters=4).threshold == 0.0
