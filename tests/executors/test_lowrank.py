"""The exact low-rank path against plain local SGD (the reference), on generated clients:
float64 to 1e-12 and float32 to 1e-5 relative, full batch and mini-batches, with and without a
proximal term, clients of unequal size in one stack."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stocfl.client.models import FlatModel
from stocfl.client.training import LocalTraining, local_sgd
from stocfl.executors.lowrank import LowRankTrainer, flops, structure


def mlp(d, h, k, bias=True, depth=1):
    layers = [nn.Flatten(), nn.Linear(d, h, bias=bias), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(h, h), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(h, k))


def reference_and_lowrank(dtype, d, h, k, sizes, epochs, batch, lr, mu, prox, bias, depth, seed):
    g = torch.Generator().manual_seed(seed)
    module = mlp(d, h, k, bias, depth)
    flat = FlatModel(module)
    s = structure(flat)
    assert s is not None
    c, n_max = len(sizes), max(sizes)
    w = (0.3 * torch.randn(c, flat.n_params, generator=g)).to(dtype)
    centers = (
        (w + 0.2 * torch.randn(c, flat.n_params, generator=g).to(dtype))
        if prox == "other"
        else (w.clone() if prox == "start" else None)
    )
    x = torch.zeros(c, n_max, 1, d, dtype=dtype)
    y = torch.zeros(c, n_max, dtype=torch.long)
    for i, n in enumerate(sizes):
        x[i, :n] = torch.randn(n, 1, d, generator=g).to(dtype)
        y[i, :n] = torch.randint(0, k, (n,), generator=g)
    seeds = [seed * 31 + i for i in range(c)]
    mus = torch.full((c,), mu if centers is not None else 0.0)
    ref = torch.stack(
        [
            local_sgd(
                flat,
                x[i, :n],
                y[i, :n],
                w[i],
                LocalTraining.sgd(epochs, batch, lr),
                seeds[i],
                None if centers is None else centers[i],
                float(mus[i]),
            )
            for i, n in enumerate(sizes)
        ]
    )
    got = LowRankTrainer(s).train(w.clone(), centers, mus, x, y, sizes, epochs, batch, lr, seeds)
    return ref, got, w


cases = dict(
    d=st.integers(2, 40),
    h=st.integers(1, 12),
    k=st.integers(2, 5),
    sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4),
    epochs=st.integers(1, 3),
    batch=st.sampled_from([0, 1, 3, 5]),
    lr=st.sampled_from([0.01, 0.1, 0.5]),
    mu=st.sampled_from([0.0, 0.1, 1.0]),
    prox=st.sampled_from([None, "start", "other"]),
    bias=st.booleans(),
    depth=st.integers(1, 2),
    seed=st.integers(0, 10_000),
)


def assert_agrees(dtype, rel, kw):
    ref, got, _ = reference_and_lowrank(dtype, **kw)
    scale = max(1.0, float(ref.abs().max()))
    assert float((got - ref).abs().max()) <= rel * scale, float((got - ref).abs().max())


@settings(max_examples=120, deadline=None)
@given(**cases)
def test_lowrank_equals_plain_sgd_in_float64(**kw):
    assert_agrees(torch.float64, 1e-12, kw)


@settings(max_examples=60, deadline=None)
@given(**cases)
def test_lowrank_equals_plain_sgd_in_float32(**kw):
    assert_agrees(torch.float32, 1e-5, kw)


def test_which_models_qualify_and_what_each_path_costs():
    assert structure(FlatModel(mlp(784, 2048, 10))) is not None
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    assert structure(FlatModel(conv)) is None
    bn = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))
    assert structure(FlatModel(bn)) is None
    s = structure(FlatModel(mlp(784, 2048, 10)))
    plain, low = flops(s, n=50, epochs=5, batch=0, prox_distinct=False)  # the StoCFL paper's MNIST client
    assert low < plain / 2.5, (plain, low)
    plain, low = flops(s, n=2000, epochs=1, batch=10, prox_distinct=True)  # many samples: no gain
    assert low > plain


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 40),
    st.integers(1, 24),
    st.integers(2, 6),
    st.integers(1, 3),
    st.integers(1, 30),
    st.integers(1, 3),
    st.sampled_from([0, 1, 4, 7]),
    st.booleans(),
    st.booleans(),
)
def test_the_cost_model_counts_what_each_path_computes(d, h, k, depth, n, epochs, batch, prox, bias):
    """``flops`` is the arithmetic each path does, as FlopCounterMode counts it running it:
    plain local SGD (4dh a sample for the first layer: its input needs no gradient) and the
    low-rank trainer (with a proximal center other than the start, its dearer case)."""
    from stocfl.client.flops import count_flops

    flat = FlatModel(mlp(d, h, k, bias, depth))
    s = structure(flat)
    g = torch.Generator().manual_seed(0)
    w = 0.1 * torch.randn(flat.n_params, generator=g)
    center = w + 0.1 if prox else None
    x, y = torch.randn(n, 1, d, generator=g), torch.randint(0, k, (n,), generator=g)
    local = LocalTraining.sgd(epochs, batch, 0.1)
    plain, low = flops(s, n, epochs, batch, prox_distinct=prox)
    assert count_flops(lambda: local_sgd(flat, x, y, w, local, 1, center, 0.1 if prox else 0.0)) == plain
    trainer = LowRankTrainer(s)
    mu = torch.tensor([0.1 if prox else 0.0])
    centers = None if center is None else center[None]
    assert (
        count_flops(lambda: trainer.train(w[None].clone(), centers, mu, x[None], y[None], [n], epochs, batch, 0.1, [1]))
        == low
    )


@pytest.mark.parametrize("prox", [None, "other"])
def test_a_client_out_of_batches_is_frozen_in_the_stack(prox):
    ref, got, w = reference_and_lowrank(torch.float64, 12, 5, 3, [2, 9], 2, 2, 0.1, 0.5, prox, True, 1, 3)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)


def test_auto_takes_the_lowrank_path_where_it_costs_less():
    from stocfl.executors import choose_lowrank

    paper = FlatModel(mlp(784, 2048, 10))
    assert choose_lowrank(paper, 5, 0, 50, plain_sgd=True)  # |D| = 50 against 784 inputs
    assert not choose_lowrank(paper, 1, 10, 600, plain_sgd=True)  # many samples, small batches
    assert not choose_lowrank(paper, 5, 0, 50, plain_sgd=False)  # Adam, momentum: steps leave the span
    conv = FlatModel(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2 * 26 * 26, 10)))
    assert not choose_lowrank(conv, 5, 0, 50, plain_sgd=True)
