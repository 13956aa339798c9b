"""Local optimizers: the functional SGD-with-momentum and Adam against torch.optim on generated
gradient sequences; local training with them against a plain nn.Module + torch.optim loop;
the batched executor against the sequential one; a run from the config."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stocfl
from stocfl.client.models import build_module, make_model
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import Train, task_seed
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor, SequentialExecutor
from tests.reference import plain_training, torch_optimizer

OPTIMIZERS = st.one_of(
    st.builds(
        Optimizer,
        st.just("sgd"),
        st.sampled_from([0.01, 0.1, 0.5]),
        st.sampled_from([0.0, 0.5, 0.9, 0.99]),
        st.sampled_from([0.0, 1e-4, 0.1]),
    ),
    st.builds(
        Optimizer,
        st.just("adam"),
        st.sampled_from([1e-3, 0.01, 0.1]),
        st.just(0.0),
        st.sampled_from([0.0, 1e-4, 0.1]),
        st.sampled_from([0.0, 0.5, 0.9]),
        st.sampled_from([0.9, 0.999]),
    ),
)


@settings(max_examples=150, deadline=None)
@given(opt=OPTIMIZERS, p=st.integers(1, 40), steps=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_functional_steps_equal_torch_optim(opt, p, steps, seed):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(p, generator=g)
    grads = [torch.randn(p, generator=g) * 10 ** float(torch.randint(-3, 2, (1,), generator=g)) for _ in range(steps)]
    param = nn.Parameter(w0.clone())
    ref = torch_optimizer(opt, [param])
    w, state = w0.clone(), opt.init(w0)
    for gr in grads:
        param.grad = gr.clone()
        ref.step()
        opt.step(w, gr.clone(), state)
    torch.testing.assert_close(w, param.detach(), rtol=1e-5, atol=1e-5)


@settings(max_examples=60, deadline=None)
@given(opt=OPTIMIZERS, c=st.integers(1, 5), steps=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_a_stack_of_clients_steps_like_each_alone_and_inactive_rows_stay(opt, c, steps, seed):
    """The batched form: rows step independently; a row whose ``active`` is 0 keeps its
    weights and state (a client out of mini-batches)."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(c, 6, generator=g)
    active = [(torch.rand(c, 1, generator=g) > 0.3).float() for _ in range(steps)]
    grads = [torch.randn(c, 6, generator=g) for _ in range(steps)]
    w, state = w0.clone(), opt.init(w0)
    for a, gr in zip(active, grads):
        opt.step(w, gr, state, a)
    for i in range(c):
        wi, si = w0[i].clone(), opt.init(w0[i])
        for a, gr in zip(active, grads):
            if a[i] > 0:
                opt.step(wi, gr[i], si)
        torch.testing.assert_close(w[i], wi, rtol=1e-6, atol=1e-7)


FED = build("dirichlet", load_dataset("digits"), 12, 30, alpha=0.5, seed=0)  # unequal client sizes
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
SETTINGS = {
    "momentum": dict(name="sgd", momentum=0.9, weight_decay=1e-3),
    "adam": dict(name="adam", beta1=0.8, beta2=0.99, weight_decay=1e-3),
}


def _tasks(kind, batch_size, lr):
    center = W0 + 0.05 * torch.randn(W0.shape, generator=torch.Generator().manual_seed(1))
    return [
        Train(
            i,
            W0 + 0.001 * i,
            LocalTraining(3, batch_size, Optimizer(lr=lr, **SETTINGS[kind])),
            task_seed(0, 1, i),
            center if i % 2 else None,
            0.5,
        )
        for i in range(FED.n_clients)
    ]


@pytest.mark.parametrize("kind, lr", [("momentum", 0.05), ("adam", 0.01)])
def test_local_training_equals_a_plain_torch_optim_loop(kind, lr):
    t = _tasks(kind, 7, lr)[3]
    assert t.prox_center is not None
    ref = plain_training(build_module("auto", FED.input_shape, 10), t, *FED.train_data(t.client))
    got = SequentialExecutor(FED, MODEL).execute([t])[0].weights
    assert torch.allclose(ref, got, atol=1e-5), float((ref - got).abs().max())


@pytest.mark.parametrize("kind, lr", [("momentum", 0.05), ("adam", 0.01)])
@pytest.mark.parametrize("batch_size", [0, 7])
def test_batched_equals_sequential_with_every_optimizer(kind, lr, batch_size):
    tasks = _tasks(kind, batch_size, lr)
    a = SequentialExecutor(FED, MODEL).execute(tasks)
    b = BatchedExecutor(FED, MODEL, chunk_size=5).execute(tasks)
    plain = SequentialExecutor(FED, MODEL).execute(
        [dataclasses.replace(t, local=LocalTraining.sgd(3, batch_size, lr)) for t in tasks]
    )
    for x, y, z in zip(a, b, plain):
        assert torch.allclose(x.weights, y.weights, atol=1e-5, rtol=0)
        assert not torch.allclose(x.weights, z.weights, atol=1e-4), "the optimizer setting is used"


def test_adam_from_the_config_runs_and_the_same_seed_gives_the_same_numbers():
    cfg = {
        "train": {"optimizer": "adam", "lr": 0.01, "epochs": 2, "weight_decay": 1e-4},
        "run": {"rounds": 5},
        "algorithm": {"name": "fedavg"},
        "scenario": {"name": "iid", "n_clients": 10, "samples_per_client": 50},
    }
    a, b = stocfl.run(cfg), stocfl.run(cfg)
    assert a.metrics == [dict(r, seconds=a.metrics[k]["seconds"]) for k, r in enumerate(b.metrics)]
    assert a.summary["accuracy"] > 0.5
