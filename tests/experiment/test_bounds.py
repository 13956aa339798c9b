"""Bounds that follow the model (issue 70, finding 7). A reply in the model's space is bounded
by how far it moved from what was sent, relative to that model's scale and to the round's
other replies, not by an absolute 1e6: honest replies of large-scale models pass, the honest
members of a cluster a poisoned reply moved are not blamed for it, and a round (or an
evaluation) in which every client fails stops the run with one line instead of finishing with
accuracy null."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import stocfl
from stocfl.client.tasks import MAX_ABS, Evaluated, Train, Trained, out_of_bound
from stocfl.errors import UserError
from stocfl.executors import SequentialExecutor
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment
from tests.experiment.test_hostile import EVIL, SMALL

RAW = {  # SMALL as a dict, for runs given a model in Python (no [model] section)
    "scenario": {"n_clients": 12, "samples_per_client": 20},
    "run": {"rounds": 4, "sample_rate": 0.5, "engine": "sequential"},
}


@settings(max_examples=300, deadline=None)
@given(
    moves=st.lists(st.floats(0, 1e13, allow_nan=False), min_size=1, max_size=12),
    scale=st.floats(0, 1e8, allow_nan=False),
)
def test_the_bound_is_the_plain_leave_one_out_median_rule(moves, scale):
    """out_of_bound (ranks over one sort) against the rule written plainly: reply k is out when
    its move exceeds 1e6 * max(1, the sent model's largest entry, the lower median of the others)."""
    w = torch.zeros(3)
    w[0] = scale
    tasks = [Train(k, w, None, 0) for k in range(len(moves))]  # the bound reads the weights only
    replies = [Trained(w + torch.tensor([0.0, m, 0.0]), 1) for m in moves]
    got = out_of_bound(tasks, replies)
    want = set()
    for k, m in enumerate(moves):
        m = float(torch.tensor(m))  # as the float32 reply holds it
        others = [float(torch.tensor(x)) for j, x in enumerate(moves) if j != k]
        median = statistics.median_low(others) if others else 0.0
        if m > MAX_ABS * max(1.0, float(torch.tensor(scale)), median):
            want.add(k)
    assert set(got) == want


def test_honest_replies_of_a_model_with_a_bias_of_1e7_pass():
    """Every reply of this model was dropped as 'beyond 1e6', the model never changed, and the
    run finished with accuracy null, exit 0. (At 1e7, float32 holds logits to within 1, so this
    model learns little: the bound must not be what stops it.)"""
    cfg = configure.load(overrides=[*SMALL, "model.name=mlp", "model.hidden=16"])
    probe = Experiment(cfg, None)
    module = nn.Sequential(
        nn.Flatten(), nn.Linear(int(np.prod(probe.fed.input_shape)), 16), nn.ReLU(), nn.Linear(16, 10)
    )
    torch.manual_seed(0)
    with torch.no_grad():
        module[3].bias.fill_(1e7)  # the same for every class: the logits' differences are as usual
    result = stocfl.run(RAW, model=module, progress=False)
    assert all(r["dropped"] == 0 for r in result.metrics) and result.summary["accuracy"] is not None


def test_honest_replies_of_a_batchnorm_model_on_inputs_of_scale_1e4_pass():
    """Its running variance reaches ~1e8 in round 1 in every client's reply: relative to the
    round's others, no reply is out of bound."""
    fed = Experiment(configure.load(overrides=SMALL), None).fed
    scaled = lambda xy: (xy[0] * 1e4, xy[1])  # noqa: E731
    train = [scaled(fed.train_data(i)) for i in range(fed.n_clients)]
    test = [scaled(fed.test_data(i)) for i in range(fed.n_clients)]
    big = stocfl.Federation.from_arrays(train, test, n_classes=fed.n_classes)
    d = int(np.prod(fed.input_shape))
    torch.manual_seed(0)
    module = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(d), nn.Linear(d, 10))
    result = stocfl.run({"run": RAW["run"]}, federation=big, model=module, progress=False)
    assert all(r["dropped"] == 0 for r in result.metrics) and result.summary["accuracy"] > 0.3


class Crafting(SequentialExecutor):
    """Honest clients but those in ``who``, which answer tasks of type ``kind`` with ``craft(task, result)``."""

    def __init__(self, fed, model, kind, craft, who):
        super().__init__(fed, model)
        self.kind, self.craft, self.who = kind, craft, who

    def execute(self, tasks):
        results = super().execute(tasks)
        return [
            self.craft(t, r) if t.client in self.who and isinstance(r, self.kind) else r for t, r in zip(tasks, results)
        ]


def _run(tmp_path, algorithm, kind, craft, who, rounds=4):
    cfg = configure.load(overrides=[*SMALL, f"algorithm.name={algorithm}", f"run.rounds={rounds}"])
    probe = Experiment(cfg, None)
    ex = Crafting(probe.fed, probe.model, kind, craft, who)
    summary = Experiment.create(cfg, tmp_path, ex).run(progress=False)
    return summary, [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["stocfl", "fedavg"])
def test_the_honest_members_of_a_poisoned_cluster_are_not_dropped(tmp_path, algorithm):
    """Client 3 moves every weight by 9.9e5 (inside the old absolute bound) from the model it
    is sent, in every round: the model its cluster then sends its members drifts beyond 1e6,
    and so do their honest replies, which the absolute bound dropped. Only client 3 may ever be
    dropped, never they."""
    poison = lambda t, r: Trained(t.weights + 9.9e5, r.n_samples)  # noqa: E731
    _, rows = _run(tmp_path, algorithm, Trained, poison, {EVIL}, rounds=6)
    assert all(set(r["dropped_clients"]) <= {EVIL} for r in rows), [r["dropped_clients"] for r in rows]


def test_a_reply_far_beyond_the_others_is_dropped_by_its_sender(tmp_path, caplog):
    far = lambda t, r: Trained(t.weights + 1e9, r.n_samples)  # noqa: E731
    _, rows = _run(tmp_path, "fedavg", Trained, far, {EVIL})
    assert any(r["dropped_clients"] == [EVIL] for r in rows) and all(r["dropped_clients"] in ([], [EVIL]) for r in rows)
    said = [m for m in caplog.messages if "moved 1e+09 from the model sent" in m]
    assert said and all(m.startswith("round") and f"client {EVIL}: bad reply" in m for m in said), caplog.messages


@pytest.mark.parametrize(
    "kind, craft, says",
    [
        (Trained, lambda t, r: Trained(r.weights * float("nan"), r.n_samples), "every client of the round was dropped"),
        (Evaluated, lambda t, r: Evaluated(float("nan"), r.correct, r.n_samples), "evaluation: every client failed"),
    ],
    ids=["training", "evaluation"],
)
def test_a_round_in_which_every_client_fails_stops_with_one_line(tmp_path, kind, craft, says):
    """It used to finish every round with accuracy null and exit 0."""
    with pytest.raises(UserError) as err:
        _run(tmp_path, "fedavg", kind, craft, set(range(12)))
    line = str(err.value)
    assert "\n" not in line and line.startswith("round 1: ") and says in line, line
    assert "bad reply" in line and f"stocfl resume {tmp_path}" in line and "checkpoint of round 0" in line
