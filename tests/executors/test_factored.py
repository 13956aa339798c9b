"""Factored replies of the low-rank path (``run.factored_replies``) against the plain, formed
ones: each reply's weights, the mean aggregated from factors, the replies' checks (the same
verdicts, refusals and out-of-bound moves), and whole runs (the same clusters, the same
traffic, numbers to float rounding, no reply formed where the algorithm only averages)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import stocfl
from stocfl.algorithms.aggregation import Aggregator, weighted_mean
from stocfl.client.models import FlatModel
from stocfl.client.tasks import (
    MAX_ABS,
    BadResult,
    FactoredTrained,
    Train,
    Trained,
    check_result,
    checking,
    out_of_bound,
)
from stocfl.client.training import LocalTraining
from stocfl.executors.batched import BatchedExecutor
from tests.executors.test_lowrank import mlp


def factored(g, d, h, tail, n, start, center, scale=1.0):
    """A factored reply of n samples from ``start`` (and ``center``), its factors drawn."""
    return FactoredTrained(
        start,
        center,
        float(1 - 0.1 * torch.rand(1, generator=g)),
        0.0 if center is None else float(0.1 * torch.rand(1, generator=g)),
        scale * torch.randn(n, h, generator=g),
        torch.randn(n, d, generator=g),
        start[h * d :] + 0.1 * torch.randn(tail, generator=g),
        n,
    )


@settings(max_examples=60, deadline=None)
@given(
    d=st.integers(1, 30),
    h=st.integers(1, 10),
    tail=st.integers(0, 20),
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=7),
    starts=st.integers(1, 3),
    centers=st.integers(0, 2),
    dense=st.integers(0, 2),
    seed=st.integers(0, 10_000),
)
def test_the_mean_from_factors_is_the_mean_of_the_formed_replies(d, h, tail, sizes, starts, centers, dense, seed):
    """Replies from a few shared starts and centers, with dense ones among them, and weights
    of every size: the mean summed from the factors equals the float64 mean of the formed
    replies to float32 rounding, and a reply's weights are its formed first layer and tail."""
    g = torch.Generator().manual_seed(seed)
    p = h * d + tail
    w0 = [torch.randn(p, generator=g) for _ in range(starts)]
    cs = [torch.randn(p, generator=g) for _ in range(centers)]
    replies: list = [
        factored(g, d, h, tail, n, w0[i % starts], cs[i % centers] if cs else None) for i, n in enumerate(sizes)
    ]
    replies += [torch.randn(p, generator=g) for _ in range(dense)]
    weights = (torch.rand(len(replies), generator=g) + 0.01).tolist()
    formed = [r.weights if isinstance(r, FactoredTrained) else r for r in replies]
    for r in replies[: len(sizes)]:
        first = r.alpha * r.start[: h * d].view(h, d) + r.A.T @ r.X
        if r.center is not None:
            first = first + r.beta * r.center[: h * d].view(h, d)
        assert torch.allclose(r.weights[: h * d], first.reshape(-1), atol=1e-5)
        assert torch.equal(r.weights[h * d :], r.tail)
    got, want = weighted_mean(replies, weights), weighted_mean(formed, weights)
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max().clamp(min=1))), (
        (got - want).abs().max()
    )
    # the other rules form the replies, and give what the formed replies give
    for rule in ("clip", "median", "trimmed_mean"):
        agg = Aggregator(rule, trim=0.2)
        assert torch.equal(agg(replies, weights, w0[0]), agg(formed, weights, w0[0]))


def chunk_tasks(seed, sizes, prox, batch):
    g = torch.Generator().manual_seed(seed)
    d, h, k = 12, 6, 3
    flat = FlatModel(mlp(d, h, k))
    fed = stocfl.Federation.from_arrays(
        [(torch.randn(n, 1, d, generator=g), torch.randint(0, k, (n,), generator=g)) for n in sizes],
        [(torch.randn(1, 1, d, generator=g), torch.randint(0, k, (1,), generator=g)) for _ in sizes],
        n_classes=k,
    )
    w = 0.3 * torch.randn(flat.n_params, generator=g)
    other = 0.3 * torch.randn(flat.n_params, generator=g)
    local = LocalTraining.sgd(2, batch, 0.1)
    center = {"none": None, "start": w, "other": other}[prox]
    tasks = [
        Train(i, w if i % 2 else other, local, seed + i, center if i % 3 else None, 0.5) for i in range(len(sizes))
    ]
    if prox == "start":  # FedProx: each row's center is its own start
        tasks = [Train(t.client, t.weights, local, t.seed, t.weights, 0.5) for t in tasks]
    return fed, flat, tasks


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    sizes=st.lists(st.integers(1, 9), min_size=1, max_size=6),
    prox=st.sampled_from(["none", "start", "other"]),
    batch=st.sampled_from([0, 2, 4]),
)
def test_the_executors_factored_replies_are_its_formed_ones(seed, sizes, prox, batch):
    """The low-rank executor's replies with and without factoring, on generated clients,
    starts, centers and mini-batches: the same samples, weights to float rounding, and every
    reply's check passes alike."""
    fed, flat, tasks = chunk_tasks(seed, sizes, prox, batch)
    plain = BatchedExecutor(fed, flat, lowrank=True).execute(tasks)
    facts = BatchedExecutor(fed, flat, lowrank=True, factored=True).execute(tasks)
    assert all(isinstance(r, FactoredTrained) for r in facts) and not any(isinstance(r, FactoredTrained) for r in plain)
    for t, a, b in zip(tasks, plain, facts):
        assert a.n_samples == b.n_samples and torch.equal(b.start, t.weights) and b.start is not t.weights
        assert torch.allclose(a.weights, b.weights, rtol=1e-5, atol=1e-6)
        assert b.move_bound() >= float((b.weights - t.weights).abs().max()) * (1 - 1e-6)


def check_all(tasks, replies):
    """The verdicts of the replies' checks as the run takes them: refused (why) or out of bound."""
    out, refused = [], {}
    with checking():
        passed = []
        for k, (t, r) in enumerate(zip(tasks, replies)):
            try:
                out.append(check_result(t, r, r.n_samples, 1))
                passed.append(k)
            except BadResult as err:
                refused[k] = str(err)
        bound = {passed[j]: why for j, why in out_of_bound([tasks[k] for k in passed], out).items()}
    return refused, bound


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 7),
    scales=st.lists(st.sampled_from([0.0, 1.0, 1e3, 1e7, 1e12, float("nan"), float("inf")]), min_size=2, max_size=7),
    seed=st.integers(0, 10_000),
)
def test_factored_replies_get_the_verdicts_of_their_formed_ones(n, scales, seed):
    """Replies whose updates are honest, large, beyond any bound, NaN or infinite: checked as
    factors they are refused and found out of bound exactly as their formed weights are (the
    move bound decides only where no move could be out of bound)."""
    g = torch.Generator().manual_seed(seed)
    d, h, tail = 5, 3, 4
    w0 = torch.randn(h * d + tail, generator=g)
    local = LocalTraining.sgd(1, 0, 0.1)
    tasks = [Train(i, w0, local, i) for i in range(len(scales))]
    replies = []
    for s in scales:
        r = factored(g, d, h, tail, n, w0, None)
        r.A.mul_(s)  # the update's size: NaN and inf spread as they would from a diverged training
        replies.append(r)
    formed = [Trained(r.weights.clone(), r.n_samples) for r in replies]
    assert check_all(tasks, replies) == check_all(tasks, formed)
    if all(s < MAX_ABS for s in scales):
        assert check_all(tasks, replies) == ({}, {})


def test_a_start_written_in_place_after_the_reply_is_refused_not_misread():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(3 * 5 + 4, generator=g)
    r = factored(g, 5, 3, 4, 6, w0, None)
    w0.add_(1.0)
    with pytest.raises(RuntimeError, match="changed in place"):
        r.form()
    with pytest.raises(RuntimeError, match="changed in place"):
        weighted_mean([r], [1.0])


def test_a_run_with_factored_replies_keeps_its_clusters_and_traffic_and_forms_none(monkeypatch):
    """StoCFL on the low-rank engine, both forms: the same clusters every round, the same bytes
    up and down, models to float rounding; with factors, no reply is formed (StoCFL only
    averages its replies)."""
    formed = []
    form = FactoredTrained.form
    monkeypatch.setattr(FactoredTrained, "form", lambda self: formed.append(1) or form(self))
    runs = {}
    for f in (False, True):
        cfg = stocfl.as_config(
            {"algorithm": {"name": "stocfl"}, "run": {"engine": "lowrank", "rounds": 5, "factored_replies": f}}
        )
        runs[f] = stocfl.run(cfg)
    a, b = runs[False], runs[True]
    assert not formed
    assert [m["n_clusters"] for m in a.metrics] == [m["n_clusters"] for m in b.metrics]
    assert np.array_equal(a.labels, b.labels)
    for key in ("bytes_up", "bytes_down"):
        assert [m[key] for m in a.metrics] == [m[key] for m in b.metrics]
    for name, model in a.models.items():
        for t in model:
            assert torch.allclose(model[t], b.models[name][t], atol=1e-5), (name, t)
    assert abs(a.summary["accuracy"] - b.summary["accuracy"]) <= 1e-3
