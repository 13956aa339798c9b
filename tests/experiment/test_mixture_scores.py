"""The mixture score (mean total-variation distance between found and true shares) on cases
worked by hand, and in a run on a mixed scenario."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stocfl
from stocfl.experiment.metrics import mixture_distance

TRUE = np.array([[0.7, 0.3], [0.2, 0.8], [1.0, 0.0]])


def test_found_shares_equal_to_the_true_ones_score_zero_whatever_the_clusters_are_called():
    labels = np.array([1, 0, 1])
    assert mixture_distance(labels, TRUE[:, ::-1].copy(), TRUE) == pytest.approx(0.0)


def test_a_hard_assignment_costs_each_client_its_other_shares():
    labels = np.array([5, 9, 5])  # cluster 5 stands for group 0, 9 for group 1
    assert mixture_distance(labels, None, TRUE) == pytest.approx((0.3 + 0.2 + 0.0) / 3)
    one = np.zeros(3, dtype=np.int64)  # one model for all: it stands for group 0
    assert mixture_distance(one, None, TRUE) == pytest.approx((0.3 + 0.8 + 0.0) / 3)


def test_a_group_split_in_two_clusters_costs_nothing_and_unplaced_clients_do_not_count():
    split = np.array([[0.4, 0.3, 0.3], [0.1, 0.1, 0.8], [0.5, 0.5, 0.0]])  # clusters 0, 1 both group 0
    assert mixture_distance(np.array([0, 2, 0]), split, TRUE) == pytest.approx(0.0)
    labels = np.array([0, -1, 0])
    weights = np.array([[0.7, 0.3], [np.nan, np.nan], [1.0, 0.0]])
    assert mixture_distance(labels, weights, TRUE) == pytest.approx(0.0)
    assert mixture_distance(np.full(3, -1), None, TRUE) is None
    one, two = np.zeros(3, dtype=np.int64), [0, 1]  # over clients 0 and 1 one cluster is most like group 1
    assert mixture_distance(one, None, TRUE, participants=two) == pytest.approx((0.7 + 0.2) / 2)


def test_a_run_on_a_mixed_scenario_scores_every_round_and_others_do_not():
    cfg = {"scenario": {"name": "rotated_mixture", "alpha": 0.3}, "run": {"rounds": 3, "sample_rate": 0.5}}
    for name in ("fedsoft", "fedavg"):
        res = stocfl.run({**cfg, "algorithm": {"name": name}})
        tv = [r["mixture_tv"] for r in res.metrics]
        assert all(v is None or 0 <= v <= 1 for v in tv) and tv[-1] is not None
        assert res.summary["mixture_tv"] == tv[-1]
    plain = stocfl.run({"run": {"rounds": 2}, "algorithm": {"name": "fedavg"}})
    assert "mixture_tv" not in plain.metrics[-1] and "mixture_tv" not in plain.summary


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 12), g=st.integers(1, 5), k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_the_score_is_a_distance_in_zero_one_and_zero_for_the_truth_in_any_order(n, g, k, seed):
    """(Zero for the truth from two clients on: over one client every column is alike, and no
    naming can tell the groups apart.)"""
    rng = np.random.default_rng(seed)
    true = rng.dirichlet(np.full(g, 0.5), size=n)
    found = rng.dirichlet(np.ones(k), size=n)
    labels = found.argmax(1)
    assert 0.0 <= mixture_distance(labels, found, true) <= 1.0 + 1e-12
    assert 0.0 <= mixture_distance(labels, None, true) <= 1.0 + 1e-12
    order = rng.permutation(g)
    if n >= 2:
        assert mixture_distance(true[:, order].argmax(1), true[:, order], true) == pytest.approx(0.0, abs=1e-9)
