"""Client FLOPs, counted: a task's count against its closed form on an MLP, the counter's reuse
of a count per task shape against counting every task afresh (generated task lists over every
built-in kind), a user's kind counted like a built-in, and a run's per-round FLOPs the same
whatever engine runs it."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stocfl
from stocfl.algorithms.stocfl.representation import Represent
from stocfl.client.descriptor import Describe
from stocfl.client.flops import FlopCount, count_flops, svd_flops
from stocfl.client.gradient import Gradient
from stocfl.client.mixture import EvaluateMixture, MixtureTrain
from stocfl.client.models import make_model
from stocfl.client.subspace import Subspace
from stocfl.client.tasks import Evaluate, Train, kind_of, register_task
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.experiment.loop import Experiment

FED = build("dirichlet", load_dataset("digits"), 8, 20, alpha=0.3, seed=2)  # unequal sizes and labels
MODEL, W0 = make_model("mlp", FED.input_shape, 10, 24, seed=0)
D, H, C = 64, 24, 10


def test_train_counts_the_mlp_closed_form():
    """Per sample: forward 2dh + 2hC, the weights' gradients 2dh + 2hC, the hidden layer's input
    gradient 2hC (none for the input itself): 4dh + 6hC, times epochs x samples, whatever the
    batch size; an evaluation is the forward alone."""
    count = FlopCount(FED, MODEL)
    for client, epochs, batch in ((0, 1, 0), (3, 2, 5), (5, 3, 7)):
        n = int(FED.train_sizes[client])
        t = Train(client, W0, LocalTraining.sgd(epochs, batch, 0.1), seed=1)
        assert count(t) == epochs * n * (4 * D * H + 6 * H * C)
        n_test = int(FED.test_sizes[client])
        assert count(Evaluate(client, W0, "test")) == n_test * (2 * D * H + 2 * H * C)


def test_svd_formula():
    a = torch.randn(3, 40, 12, dtype=torch.float64)
    assert count_flops(torch.linalg.svd, a) == 3 * (6 * 40 * 12**2 + 20 * 12**3) == svd_flops((3, 40, 12))
    assert svd_flops((12, 40)) == svd_flops((40, 12))


def tasks_strategy():
    client = st.integers(0, FED.n_clients - 1)
    local = st.builds(LocalTraining.sgd, st.integers(0, 2), st.sampled_from([0, 3, 8]), st.just(0.05))
    models = st.integers(1, 3).map(lambda k: W0.repeat(k, 1))
    linear = torch.zeros(C * (D + 1))
    kinds = st.sampled_from(["gradient", "update"])
    return st.one_of(
        st.builds(Train, client, st.just(W0), local, st.integers(0, 9)),
        st.builds(Evaluate, client, st.just(W0), st.sampled_from(["train", "test"])),
        st.builds(Gradient, client, st.just(W0)),
        st.builds(Represent, client, st.just(W0), kinds, st.just("train"), local),
        st.builds(Represent, client, st.just(linear), kinds, st.just("linear"), local),
        st.builds(Subspace, client, st.integers(1, 4), st.just(D), st.just(C)),
        st.builds(Describe, client, st.just(W0), st.integers(1, 5), st.integers(0, 3), st.just(C), st.booleans()),
        st.builds(MixtureTrain, client, models, local, st.integers(0, 3)),
        st.builds(lambda c, m: EvaluateMixture(c, m, torch.full((len(m),), 1 / len(m))), client, models),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tasks_strategy(), min_size=1, max_size=8))
def test_a_count_reused_per_shape_equals_counting_every_task(tasks):
    """The counter counts a task shape once: for any task list, each task's reused count is the
    one counting that task alone gives (so the shape key holds everything a count depends on)."""
    count = FlopCount(FED, MODEL)
    for t in tasks:
        alone = count_flops(kind_of(type(t)).reference, count.client(t.client), t)
        assert count(t) == alone, t


def test_counts_shared_across_runs_are_the_models_own():
    """A process shares its counts between runs (each FlopCount of the same model and samples
    reuses the others'), keyed by the model as it prints: two models whose tensors have the same
    shapes but whose convolutions stride differently (so differ in arithmetic) each get their own
    count, and a new FlopCount of the first model finds its counts without counting again."""
    from torch import nn

    from stocfl.client.models import FlatModel

    def conv(stride):
        module = nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=stride), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, C)
        )
        return FlatModel(module), FlatModel.init_weights(module, 0)

    (one, w1), (two, w2) = conv(1), conv(2)
    assert one.shapes == two.shapes
    counts = []
    for model, w in ((one, w1), (two, w2), (one, w1)):
        count = FlopCount(FED, model)
        for t in (Train(3, w, LocalTraining.sgd(1, 4, 0.1), seed=0), Evaluate(5, w, "test")):
            assert count(t) == count_flops(kind_of(type(t)).reference, count.client(t.client), t), (model, t)
        counts.append((count(Evaluate(5, w, "test")), count.seconds))
    assert counts[0][0] > counts[1][0]  # stride 1 does more arithmetic than stride 2
    assert counts[2][0] == counts[0][0] and counts[2][1] == 0.0  # found, not counted again


def test_a_users_kind_is_counted():
    @dataclass(frozen=True, eq=False)
    class Gram:
        client: int

    @dataclass(frozen=True, eq=False)
    class Grammed:
        trace: float

    def gram(c, t):
        x = c.x.flatten(1)
        return Grammed(float(torch.trace(x.T @ x)))

    @dataclass(frozen=True, eq=False)
    class Kernel:  # the samples' Gram matrix: a count quadratic in the client's size
        client: int

    def kernel(c, t):
        x = c.x.flatten(1)
        return Grammed(float((x @ x.T).sum()))

    try:
        register_task(Gram, Grammed, gram, "query.flopsgram")
        register_task(Kernel, Grammed, kernel, "query.flopskernel")
        count = FlopCount(FED, MODEL)
        for i in range(FED.n_clients):  # clients of other sizes: each count exact, affine or not
            n = int(FED.train_sizes[i])
            assert count(Gram(i)) == 2 * n * D * D and count(Kernel(i)) == 2 * n * n * D, i
    finally:
        from stocfl.client.tasks import KINDS

        KINDS.pop(Gram, None)
        KINDS.pop(Kernel, None)


@pytest.mark.parametrize("algorithm", ["stocfl", "fedem", "pacfl"])
def test_a_runs_flops_do_not_depend_on_the_engine(tmp_path, algorithm):
    """The count is of the method's client computation, not of the engine's arithmetic: the
    batched engine's rows carry the sequential engine's FLOPs, round by round (and every
    round has a count)."""
    rows = {}
    for engine in ("sequential", "batched"):
        cfg = stocfl.load_config(
            None,
            [
                f"algorithm.name={algorithm}",
                "run.rounds=3",
                "run.eval_every=3",
                f"run.engine={engine}",
                "scenario.n_clients=12",
            ],
        )
        out = tmp_path / engine
        Experiment.create(cfg, out).run(progress=False)
        rows[engine] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    flops = {e: [r["flops"] for r in rs] for e, rs in rows.items()}
    assert all(isinstance(f, int) and f > 0 for f in flops["sequential"])
    assert flops["sequential"] == flops["batched"]


def _tensor_bytes_plain(item) -> int:
    """The traffic count as first written: every dataclass's fields asked afresh, recursively."""
    import dataclasses

    from stocfl.client.tasks import FactoredTrained

    if isinstance(item, torch.Tensor):
        return item.numel() * item.element_size()
    if isinstance(item, FactoredTrained):
        return item.nbytes
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        return sum(_tensor_bytes_plain(getattr(item, f.name)) for f in dataclasses.fields(item))
    if isinstance(item, (list, tuple)):
        return sum(_tensor_bytes_plain(x) for x in item)
    return 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tasks_strategy(), min_size=1, max_size=6))
def test_traffic_counted_with_cached_fields_equals_the_plain_walk(tasks):
    """A round's traffic (stocfl.experiment.build.tensor_bytes, with each type's fields found
    once) against the plain recursive walk, on every built-in task kind and on each task's
    reply as the reference computes it (mixtures' models inside, Psi, subspaces), and on lists,
    numbers and types."""
    from stocfl.experiment.build import tensor_bytes

    count = FlopCount(FED, MODEL)
    for t in tasks:
        reply = kind_of(type(t)).reference(count.client(t.client), t)
        for item in (t, reply, [t, (reply, 3)], 2.5, "x", None, type(t)):
            assert tensor_bytes(item) == _tensor_bytes_plain(item), item
