"""A run's partition scores, kept from the last call where the partition is the same, against
scores computed afresh at every call."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.experiment import metrics


@st.composite
def partitions(draw):
    n = draw(st.integers(1, 12))
    labels = np.array(draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), dtype=np.int64)
    groups = None if draw(st.booleans()) else np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
    participants = None if draw(st.booleans()) else sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    dists = None
    if draw(st.booleans()):
        raw = np.array(draw(st.lists(st.lists(st.floats(0.01, 1), min_size=3, max_size=3), min_size=n, max_size=n)))
        dists = raw / np.linalg.norm(raw, axis=1, keepdims=True)
    return labels, groups, participants, dists


@st.composite
def runs(draw):
    """Calls as a run makes them: partitions that differ from the one before in one input or none."""
    labels, groups, participants, dists = draw(partitions())
    n = len(labels)
    calls = [(labels, groups, participants, dists)]
    for change in draw(st.lists(st.sampled_from(["none", "labels", "groups", "participants", "dists"]), max_size=8)):
        if change == "labels":
            labels = np.array(draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n)), dtype=np.int64)
        elif change == "groups":
            groups = (
                None
                if groups is not None and draw(st.booleans())
                else np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)))
            )
        elif change == "participants":
            participants = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
        elif change == "dists":
            dists = None if dists is None else dists[::-1].copy()
        calls.append((labels, groups, participants, dists))
    return calls


@settings(max_examples=80, deadline=None)
@given(runs())
def test_scores_kept_from_the_last_call_equal_scores_computed_afresh(calls):
    for labels, groups, participants, dists in calls:
        got = metrics.clustering_scores(labels.copy(), groups, participants, dists)
        want = metrics._clustering_scores(labels, groups, participants, dists)
        assert got == want or _nan_equal(got, want)
        got["n_clusters"] = -5  # the caller's copy: the next call's scores are not changed by it
    labels = labels.copy()
    labels[...] = 0  # the caller's arrays changed in place: scored anew, not taken from memory
    assert metrics.clustering_scores(labels, groups, participants, dists) == metrics._clustering_scores(
        labels, groups, participants, dists
    )


def _nan_equal(a, b):
    return a.keys() == b.keys() and all(x == y or (x != x and y != y) for x, y in zip(a.values(), b.values()))
