"""Robust aggregation: each rule against a plain reference on generated inputs, and what a
crafted (in-bounds) reply does to a run with each rule."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.algorithms import aggregation
from stocfl.algorithms.aggregation import Aggregator
from stocfl.client.tasks import Trained
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment
from tests.experiment.test_hostile import Client


def reference(rule, vectors, weights, start, clip_norm, trim):
    x = np.stack([v.double().numpy() for v in vectors])
    a = np.asarray(weights, dtype=np.float64)
    if rule == "mean":
        return (a[:, None] * x).sum(0) / a.sum()
    if rule == "clip":
        d = x - start.double().numpy()
        norms = np.linalg.norm(d, axis=1)
        c = clip_norm if clip_norm > 0 else np.median(norms)
        clipped = np.stack([di * min(1.0, c / n) if n > 0 else di for di, n in zip(d, norms)])
        return start.double().numpy() + (a[:, None] * clipped).sum(0) / a.sum()
    if rule == "median":
        return np.median(x, axis=0)
    return scipy.stats.trim_mean(x, trim, axis=0)


@settings(max_examples=150, deadline=None)
@given(
    rule=st.sampled_from(aggregation.RULES),
    n=st.integers(1, 9),
    d=st.integers(1, 23),
    block=st.integers(1, 40),
    clip_norm=st.sampled_from([0.0, 0.1, 1.0, 5.0]),
    trim=st.sampled_from([0.0, 0.1, 0.2, 0.34, 0.49]),
    seed=st.integers(0, 2**16),
    ties=st.booleans(),
)
def test_every_rule_equals_the_plain_reference(rule, n, d, block, clip_norm, trim, seed, ties):
    g = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(d, generator=g) * 3 for _ in range(n)]
    if ties:  # repeated values and a client that did not move
        vectors = [v.round() for v in vectors]
    start = vectors[0].clone() if ties else torch.randn(d, generator=g)
    weights = (torch.rand(n, generator=g) * 50 + 1).round().tolist()
    saved, aggregation.BLOCK = aggregation.BLOCK, block  # the coordinate-wise rules work block by block
    try:
        got = Aggregator(rule, clip_norm, trim)(vectors, weights, start)
    finally:
        aggregation.BLOCK = saved
    want = reference(rule, vectors, weights, start, clip_norm, trim)
    assert got.dtype == torch.float32 and got.shape == (d,)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-5)


def test_clip_with_one_start_per_vector_is_the_mean_of_clipped_moves():
    a, b = torch.zeros(3), torch.ones(3) * 10
    got = Aggregator("clip", clip_norm=1.0)(
        [a + torch.tensor([3.0, 0, 0]), b + torch.tensor([0, 0.5, 0])], [1, 1], [a, b]
    )
    torch.testing.assert_close(got, torch.tensor([5.5, 5.25, 5.0]))


def _run(tmp_path, name, rule, craft, algorithm="fedavg"):
    cfg = configure.load(
        overrides=[
            "scenario.name=iid",
            "scenario.n_clients=10",
            "scenario.samples_per_client=60",
            "run.rounds=8",
            "run.sample_rate=1.0",
            "train.lr=0.1",
            "train.epochs=2",
            "run.engine=sequential",
            f"aggregation.rule={rule}",
            f"algorithm.name={algorithm}",
        ]
    )
    probe = Experiment(cfg, tmp_path / f"{name}-probe")
    return Experiment.create(cfg, tmp_path / name, Client(probe.fed, probe.model, Trained, craft)).run(progress=False)


HUGE = lambda r: Trained(torch.full_like(r.weights, 1e5), r.n_samples)  # noqa: E731  within the reply bound


@pytest.mark.long
@pytest.mark.parametrize("algorithm, rules", [("fedavg", ("clip", "median", "trimmed_mean")), ("stocfl", ("median",))])
def test_robust_rules_hold_where_the_mean_is_taken_over(tmp_path, algorithm, rules):
    """One of ten clients returns weights of 1e5 (inside the reply check's bound): the mean ends
    at chance, a robust rule within 3 points of the same rule without the attacker."""
    assert _run(tmp_path, "mean-evil", "mean", HUGE, algorithm)["accuracy"] < 0.2
    for rule in rules:
        evil = _run(tmp_path, f"{rule}-evil", rule, HUGE, algorithm)["accuracy"]
        honest = _run(tmp_path, f"{rule}-honest", rule, lambda r: r, algorithm)["accuracy"]
        assert honest > 0.7 and abs(evil - honest) < 0.03, (rule, evil, honest)


@pytest.mark.parametrize(
    "bad, key",
    [
        ("aggregation.rule='max'", "aggregation.rule"),
        ("aggregation.trim=0.5", "aggregation.trim"),
        ("aggregation.clip_norm=inf", "aggregation.clip_norm"),
        ("aggregation.clip_norm=-1.0", "aggregation.clip_norm"),
    ],
)
def test_bad_aggregation_keys_are_named(bad, key):
    with pytest.raises(UserError, match=key):
        configure.load(overrides=[bad])


def _whole_vector_mean(vectors, weights):
    """The weighted mean as first written: a model-sized float64 sum, each vector added whole."""
    a = torch.as_tensor(np.asarray(weights, dtype=np.float64))
    acc = torch.zeros_like(vectors[0], dtype=torch.float64)
    for v, ai in zip(vectors, a):
        acc.add_(v.double(), alpha=float(ai))
    return (acc / a.sum()).float()


@settings(max_examples=60, deadline=None)
@given(
    n=st.sampled_from([1, 3, 8, aggregation.MEAN_BLOCK - 1, aggregation.MEAN_BLOCK + 5, 2 * aggregation.MEAN_BLOCK]),
    weights=st.lists(st.floats(0.01, 1000), min_size=1, max_size=12),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 1000),
)
def test_the_blockwise_mean_is_the_whole_vector_mean_to_the_bit(n, weights, threads, seed):
    g = torch.Generator().manual_seed(seed)
    vectors = [torch.randn(n, generator=g) * 10 ** float(torch.randint(-3, 4, (1,), generator=g)) for _ in weights]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert torch.equal(aggregation.weighted_mean(vectors, weights), _whole_vector_mean(vectors, weights))
    finally:
        torch.set_num_threads(before)
