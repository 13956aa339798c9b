"""CLoVE against plain references: the cluster-to-model matching against a search over every
injective map, the choice of K and the clustering on separated blobs, the random first round;
and the method's own steps (clustering stops once stable, a newcomer joins the model of the
nearest centroid)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score

from stocfl.algorithms import CLoVE
from stocfl.algorithms.clove import choose_k, cluster_rows, match_clusters, random_assignment
from stocfl.client.tasks import Evaluate
from stocfl.executors import SequentialExecutor
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 9), k=st.integers(1, 4), extra=st.integers(0, 3))
def test_the_matching_costs_what_the_best_injective_map_costs(seed, n, k, extra):
    rng = np.random.default_rng(seed)
    k = min(k, n)
    labels = np.concatenate([np.arange(k), rng.integers(0, k, n - k)])
    rng.shuffle(labels)
    clients = sorted(rng.choice(1000, n, replace=False).tolist())
    models = k + extra
    x = rng.uniform(0, 3, (n, models))
    to = match_clusters(labels, clients, x, "loss")
    assert len(set(to.tolist())) == k and to.min() >= 0 and to.max() < models  # every cluster its own model
    cost = np.stack([x[labels == c].sum(0) for c in range(k)])
    best = min(sum(cost[c, m[c]] for c in range(k)) for m in itertools.permutations(range(models), k))
    assert np.isclose(cost[np.arange(k), to].sum(), best)
    # the ablation: the c-th cluster in order of its lowest client gets model c
    order = match_clusters(labels, clients, x, "order")
    lowest = [min(c for c, lab in zip(clients, labels) if lab == g) for g in range(k)]
    assert [int(order[g]) for g in np.argsort(lowest)] == list(range(k))


def blobs(seed, k, per, dim):
    """k groups of ``per`` points around centres 50 apart on orthogonal axes (dim >= k), so
    that no two groups are closer than any others (the 10% rule then prefers no smaller K)."""
    rng = np.random.default_rng(seed)
    centres = 50 * np.eye(k, dim)
    truth = np.repeat(np.arange(k), per)
    return centres[truth] + rng.normal(0, 0.5, (len(truth), dim)), truth


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), k=st.integers(2, 5), per=st.integers(2, 6), more=st.integers(0, 4))
def test_separated_blobs_give_their_count_and_their_groups(seed, k, per, more):
    x, truth = blobs(seed, k, per, k + more)
    assert choose_k(x, 15, 0) == k
    for how in ("kmeans", "agglomerative"):
        labels, centroids = cluster_rows(x, k, how, 0)
        assert adjusted_rand_score(truth, labels) == 1.0
        assert labels[0] == 0 and np.allclose(centroids, [x[labels == c].mean(0) for c in range(k)])


def test_one_distinct_loss_vector_is_one_cluster():
    x = np.ones((6, 4))
    assert choose_k(x, 15, 0) == 1
    labels, centroids = cluster_rows(x, 3, "kmeans", 0)
    assert labels.tolist() == [0] * 6 and centroids.shape == (1, 4)


@given(n=st.integers(1, 40), k=st.integers(1, 15), round_=st.integers(1, 100))
def test_the_random_first_round_gives_every_model_a_client_where_it_can(n, k, round_):
    out = random_assignment(n, k, round_, 0)
    assert out.shape == (n,) and out.min() >= 0 and out.max() < k
    if n >= k:
        assert set(out.tolist()) == set(range(k))
    assert np.array_equal(out, random_assignment(n, k, round_, 0))


def experiment(*overrides):
    cfg = configure.load(overrides=["algorithm.name=clove", *overrides])
    exp = Experiment(cfg, None)
    alg = exp.algorithm
    assert isinstance(alg, CLoVE)
    return exp.fed, SequentialExecutor(exp.fed, exp.model), alg


def test_clustering_stops_once_every_sampled_client_kept_its_model():
    fed, ex, alg = experiment("algorithm.stable_rounds=2", "algorithm.n_models=2")
    asked: list[list] = []

    def ask(tasks):
        asked.append(tasks)
        return ex.execute(tasks)

    everyone = fed.participants
    for r in range(1, 30):
        asked.clear()
        out = alg.round(r, everyone, ask)
        evaluations = sum(isinstance(t, Evaluate) for tasks in asked for t in tasks)
        if out["frozen"]:
            break
        # the first round assigns at random; after it, the loss vectors: every client on both models
        assert evaluations == (0 if r == 1 else len(everyone) * 2)
        if r == 1:
            assert out["choices"] and min(out["choices"]) >= 1
    assert out["frozen"] and evaluations == 0, "a frozen round asks for no loss vector"
    h = alg.state.history[everyone]
    assert (h == h[:, -1:]).all() and np.array_equal(alg.state.labels[everyone], h[:, -1])


def test_a_newcomer_joins_the_model_of_the_nearest_centroid():
    fed, ex, alg = experiment("algorithm.n_models=3", "algorithm.init=different", "scenario.holdout=0.25")
    alg.round(1, fed.participants[:8], ex.execute)
    new = fed.heldout_clients[:4]
    x = alg.loss_vectors(new, ex.execute)
    # centroids placed on the newcomers' own loss vectors, each matched to a known model
    alg.state.centroids, alg.state.centroid_model = x.copy(), np.array([2, 0, 1, 2])[: len(new)]
    placed = alg.place_new(new, ex.execute)
    assert [p.cluster for p in placed] == alg.state.centroid_model.tolist()
    assert all(p.weights is alg.state.models[p.cluster] for p in placed)


def test_k_beyond_the_models_kept_is_refused():
    with pytest.raises(Exception, match="max_models"):
        CLoVE.Params(max_models=1)
