"""Extending stocfl from user code: the docs' "Extending stocfl" example, run as written (a data
set, a BatchNorm model, a task kind and an algorithm defined there, nowhere in the package), and
its algorithm on the sequential, batched and Flower-codec paths and by name from a config."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from pydantic import Field

import stocfl
from stocfl.algorithms.base import Placement
from stocfl.client.tasks import Train
from stocfl.executors import BatchedExecutor, SequentialExecutor
from stocfl.flower.loopback import LoopbackExecutor


def readme_example():
    """The first code block of docs/extending.md, run as it stands, as a module."""
    import re
    import sys
    import types
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "extending.md").read_text()
    code = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    module = types.ModuleType("readme_example")  # dataclasses look their module up in sys.modules
    sys.modules[module.__name__] = module
    exec(compile(code, "docs/extending.md", "exec"), module.__dict__)
    return module


EXAMPLE = readme_example()
LabelSet, LabelSetResult, label_set = EXAMPLE.LabelSet, EXAMPLE.LabelSetResult, EXAMPLE.label_set
VECTORISED_CALLS = []


def label_sets_batched(executor, tasks):  # what a batched executor runs instead, all clients at once
    VECTORISED_CALLS.append(len(tasks))
    return [label_set(executor.client(t.client), t) for t in tasks]


stocfl.register_task(LabelSet, LabelSetResult, label_set, batched=label_sets_batched)


class LabelSetParams(stocfl.algorithms.base.Params):
    min_share: float = Field(0.0, ge=0, le=1, description="unused; shows a parameter with a default")


@stocfl.register_algorithm
class WithParams(EXAMPLE.LabelSetClustering):
    """The README's algorithm with a parameter of its own (config keys come from ``Params``)."""

    name = "labelsets"
    Params = LabelSetParams


CONFIG = {
    "algorithm": {"name": "labelsets"},
    "scenario": {"name": "pathological", "n_clients": 16},
    "run": {"rounds": 4, "sample_rate": 0.5, "engine": "sequential"},
    "train": {"epochs": 2, "lr": 0.1},
}


def _play(executor_kind: str):
    from stocfl.experiment.loop import Experiment

    cfg = stocfl.as_config(CONFIG)
    probe = Experiment(cfg, None)
    ex = {
        "sequential": lambda: SequentialExecutor(probe.fed, probe.model),
        "batched": lambda: BatchedExecutor(probe.fed, probe.model),
        "codec": lambda: LoopbackExecutor(SequentialExecutor(probe.fed, probe.model), nodes=3),
    }[executor_kind]()
    exp = Experiment.create(cfg, None, ex)
    summary = exp.run(progress=False)
    return summary, exp


def test_a_toy_algorithm_with_its_own_task_kind_runs_on_every_path():
    VECTORISED_CALLS.clear()
    results = {k: _play(k) for k in ("sequential", "batched", "codec")}
    assert VECTORISED_CALLS, "the batched executor used the kind's vectorised version"
    ref_summary, ref = results["sequential"]
    assert ref_summary["ari"] == 1.0 and ref_summary["n_clusters"] == 4  # the 4 label groups of pathological
    for kind, (summary, exp) in results.items():
        assert np.array_equal(exp.algorithm.cluster_labels(), ref.algorithm.cluster_labels()), kind
        tol = 0 if kind == "codec" else 1e-5  # the codec carries numbers unchanged; vmap rounds differently
        assert torch.allclose(exp.algorithm.w, ref.algorithm.w, atol=tol, rtol=0), kind
    assert [r["label_sets"] for r in ref.rows][-1] == 4


def test_the_toy_algorithm_runs_by_name_from_the_api_and_rejects_bad_replies():
    result = stocfl.run(CONFIG)
    assert result.summary["algorithm"] == "labelsets" and len(result.models) == 5  # global + 4 clusters
    bad = LabelSetResult(torch.tensor([float("nan")] * 10), 5)
    with pytest.raises(stocfl.client.tasks.BadResult, match="NaN"):
        stocfl.client.tasks.check_result(LabelSet(0, 10), bad, 5, 5)
    with pytest.raises(stocfl.UserError, match="algorithm.min_share"):
        stocfl.run({**CONFIG, "algorithm": {"name": "labelsets", "min_share": 2.0}})


def test_the_readme_extending_example_runs_as_written():
    """A data set, a BatchNorm model, a task kind and an algorithm of the user's, by name."""
    result = EXAMPLE.result
    assert result.summary["algorithm"] == "label_sets" and result.summary["dataset"] == "my_digits"
    assert result.summary["ari"] == 1.0 and result.summary["n_clusters"] == 4, result.summary
    assert "2.running_var" in result.models["global"]  # the BatchNorm model was used


class _FedAvgLike(stocfl.Algorithm):
    """A correct user algorithm (FedAvg in a few lines) that each case below breaks in one place."""

    name = "fedavg_like"

    @dataclass
    class State:
        w: torch.Tensor

    def __init__(self, params, ctx):
        super().__init__(params, ctx)
        self.state = self.State(ctx.init_weights.clone())

    def round(self, round_, sampled, run):
        self.w = self.aggregate(run([self.local_training(round_, i, self.w) for i in sampled]), self.w)
        return {"trained": len(sampled)}

    def global_model(self):
        return self.w


stocfl.register_algorithm(_FedAvgLike)


@pytest.mark.parametrize(
    "override, message",
    [
        # each one printed a wrong figure (a user's "accuracy" as the run's, or the accuracy of the
        # first clients only) or stopped with a traceback
        ({"round": lambda self, r, s, run: {"accuracy": 1.0}}, "round(1) returned 'accuracy', a figure the runner"),
        ({"round": lambda self, r, s, run: {"ari": 1.0}}, "returned 'ari', a figure the runner measures"),
        ({"round": lambda self, r, s, run: None}, "round(1) returned a value of type NoneType"),
        ({"round": lambda self, r, s, run: {"x": np.int64(3)}}, "diagnostics that are not JSON"),
        ({"client_models": lambda self, clients, run: [self.w]}, "client_models() returned 1 models for"),
        ({"client_models": lambda self, clients, run: [self.w[:5]] * len(clients)}, "client_models() gave client 0"),
        ({"global_model": lambda self: self.w[:10]}, "global_model() returned a torch.float32 tensor of shape (10,)"),
        ({"global_model": lambda self: self.w.numpy()}, "global_model() returned a value of type ndarray"),
        ({"cluster_models": lambda self: {"a": self.w}}, "cluster_models() has key 'a'"),
        ({"cluster_models": lambda self: {0: self.w.double()}}, "cluster_models()[0] is a torch.float64 tensor"),
        (
            {"cluster_labels": lambda self: np.zeros(3, dtype=np.int64)},
            "cluster_labels() returned an array of int64 of",
        ),
        ({"cluster_labels": lambda self: [0] * self.ctx.n_clients}, "cluster_labels() returned a value of type list"),
        ({"place_new": lambda self, clients, run: []}, "place_new() must return one Placement per client asked"),
        (
            {"place_new": lambda self, clients, run: [Placement(i, 0, None, False, self.w[:3]) for i in clients]},
            "place_new() gave client",
        ),
    ],
)
def test_a_user_algorithms_faulty_output_is_one_user_error_naming_the_method(override, message):
    stocfl.register_algorithm(type("Faulty", (_FedAvgLike,), {**override, "name": "faulty"}))
    with pytest.raises(stocfl.UserError) as err:  # (held-out clients: placed by place_new at the end)
        stocfl.run({"algorithm": {"name": "faulty"}, "run": {"rounds": 2}, "scenario": {"holdout": 0.25}})
    assert message in str(err.value) and "'faulty'" in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize(
    "assignments",
    [
        lambda self: np.ones((self.ctx.n_clients, 2)),  # rows that are not distributions
        lambda self: np.full((3, 2), 0.5),  # not one row per client
        lambda self: [[1.0]] * self.ctx.n_clients,  # not an array
        lambda self: np.full((self.ctx.n_clients, 2), np.nan),  # NaN for placed clients
    ],
)
def test_a_user_algorithms_faulty_assignments_are_one_user_error_on_a_mixed_scenario(assignments):
    stocfl.register_algorithm(type("Faulty", (_FedAvgLike,), {"assignments": assignments, "name": "faulty"}))
    with pytest.raises(stocfl.UserError, match=r"'faulty': assignments\(\) returned") as err:
        stocfl.run({"algorithm": {"name": "faulty"}, "run": {"rounds": 1}, "scenario": {"name": "rotated_mixture"}})
    assert "\n" not in str(err.value)


def test_the_correct_user_algorithm_the_faulty_ones_break_runs():
    result = stocfl.run({"algorithm": {"name": "fedavg_like"}, "run": {"rounds": 2}})
    fedavg = stocfl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 2}})
    assert result.metrics[-1]["trained"] == 4 and result.summary["accuracy"] == fedavg.summary["accuracy"]


class _DropsOne(SequentialExecutor):
    def execute(self, tasks):
        return super().execute(tasks)[:-1]


class _ShortBatchedPath(SequentialExecutor):
    def fast_paths(self):
        return {**super().fast_paths(), Train: lambda tasks: self.execute_reference(Train, tasks)[:-1]}


stocfl.register_engine(stocfl.Engine("drops_one", "a faulty engine", executor=lambda f, m, cfg: _DropsOne(f, m)))
stocfl.register_engine(stocfl.Engine("short_path", "a faulty path", executor=lambda f, m, cfg: _ShortBatchedPath(f, m)))


@pytest.mark.parametrize(
    "engine, message",
    [
        ("drops_one", r"the executor returned \d+ results for \d+ tasks"),  # was an IndexError
        ("short_path", r"the Train tasks' batched path returned \d+ results for \d+ tasks"),  # was a client 'dropped'
    ],
)
def test_an_engine_that_returns_too_few_results_is_one_user_error(engine, message):
    with pytest.raises(stocfl.UserError, match=message):
        stocfl.run({"run": {"rounds": 1, "engine": engine}})
