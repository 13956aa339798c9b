"""Extending stocfl from user code: a toy algorithm with its own client computation (a task kind
defined here, nowhere in the package) runs on the sequential, batched and Flower-codec paths and
by name from a config. This file is the README's "Extending stocfl" example."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import Field

import stocfl
from stocfl.executors import BatchedExecutor, SequentialExecutor
from stocfl.flower.loopback import LoopbackExecutor


# ---- a client computation: the set of labels a client holds ------------------------------------
@dataclass(frozen=True, eq=False)
class LabelSet:
    client: int
    n_classes: int


@dataclass(frozen=True, eq=False)
class LabelSetResult:
    present: torch.Tensor  # 1.0 for every label the client holds
    n_samples: int


def label_set(c: stocfl.ClientData, t: LabelSet) -> LabelSetResult:
    return LabelSetResult((torch.bincount(c.y, minlength=t.n_classes) > 0).float(), len(c.y))


VECTORISED_CALLS = []


def label_sets_batched(executor, tasks):  # what a batched executor runs instead, all clients at once
    VECTORISED_CALLS.append(len(tasks))
    return [label_set(executor.client(t.client), t) for t in tasks]


stocfl.register_task(LabelSet, LabelSetResult, label_set, batched=label_sets_batched)


# ---- an algorithm that uses it: clients with the same label set share a model -----------------
class LabelSetParams(stocfl.algorithms.base.Params):
    min_share: float = Field(0.0, ge=0, le=1, description="unused; shows a parameter with a default")


@stocfl.register_algorithm
class LabelSetClustering(stocfl.Algorithm):
    """Each client sends the set of labels it holds once; clients with the same set form a
    cluster, trained with FedAvg inside the cluster."""

    name = "labelsets"
    Params = LabelSetParams

    @dataclass
    class State:  # everything that outlives a round; checkpointed and replayed with no code here
        w: torch.Tensor
        labels: np.ndarray
        keys: dict[str, int]  # label set, as a string of 0s and 1s -> cluster
        models: dict[int, torch.Tensor]

    def __init__(self, params, ctx):
        super().__init__(params, ctx)
        self.state = self.State(ctx.init_weights.clone(), np.full(ctx.n_clients, -1, dtype=np.int64), {}, {})

    def round(self, round_: int, sampled: list[int], run) -> dict[str, Any]:
        new = [i for i in sampled if self.labels[i] < 0]
        for i, r in zip(new, run([LabelSet(i, self.ctx.n_classes) for i in new])):
            key = "".join(str(int(b)) for b in r.present.tolist())
            self.labels[i] = self.keys.setdefault(key, len(self.keys))
        start = {i: self.models.get(int(self.labels[i]), self.w) for i in sampled}
        results = run([self.local_training(round_, i, start[i]) for i in sampled])
        for k in sorted({int(self.labels[i]) for i in sampled}):
            mine = [r for i, r in zip(sampled, results) if self.labels[i] == k]
            self.models[k] = self.aggregate(mine, self.models.get(k, self.w))
        self.w = self.aggregate(results, self.w)
        return {"label_sets": len(self.keys)}

    def global_model(self):
        return self.w

    def client_models(self, clients, run):
        return [self.models.get(int(self.labels[i]), self.w) for i in clients]

    def cluster_labels(self):
        return self.labels.copy()

    def cluster_models(self):
        return dict(self.models)


CONFIG = {"algorithm": {"name": "labelsets"}, "scenario": {"name": "pathological", "n_clients": 16},
          "run": {"rounds": 4, "sample_rate": 0.5, "engine": "sequential"}, "train": {"epochs": 2, "lr": 0.1}}


def _play(executor_kind: str):
    from stocfl.runner import Experiment

    cfg = stocfl.as_config(CONFIG)
    probe = Experiment(cfg, None)
    ex = {"sequential": lambda: SequentialExecutor(probe.fed, probe.model),
          "batched": lambda: BatchedExecutor(probe.fed, probe.model),
          "codec": lambda: LoopbackExecutor(SequentialExecutor(probe.fed, probe.model), nodes=3)}[executor_kind]()
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
    with pytest.raises(stocfl.tasks.BadResult, match="NaN"):
        stocfl.tasks.check_result(LabelSet(0, 10), bad, 5, 5)
    with pytest.raises(stocfl.UserError, match="algorithm.min_share"):
        stocfl.run({**CONFIG, "algorithm": {"name": "labelsets", "min_share": 2.0}})
