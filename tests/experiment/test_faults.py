"""Clients that fail are dropped from the round; the round completes with the rest."""

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from stocfl.algorithms import ALGORITHMS
from stocfl.client.tasks import ClientsDropped
from stocfl.executors import SequentialExecutor
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


class FailingExecutor(SequentialExecutor):
    """The sequential executor, except that the clients in ``fail`` never answer."""

    def __init__(self, federation, model, fail):
        super().__init__(federation, model)
        self.fail = set(fail)

    def execute(self, tasks):
        bad = sorted({t.client for t in tasks} & self.fail)
        results = super().execute([t for t in tasks if t.client not in self.fail])
        if bad:
            raise ClientsDropped(bad, [f"client {c}: no reply" for c in bad])
        return results


SMALL = ["scenario.n_clients=16", "scenario.samples_per_client=20", "run.rounds=4", "run.sample_rate=0.5"]
PARAMS = {"flhc": ["algorithm.warmup_rounds=1"], "fesem": ["algorithm.n_centers=2"]}


def _experiment(tmp_path, name, fail):
    cfg = configure.load(overrides=[*SMALL, f"algorithm.name={name}", *PARAMS.get(name, [])])
    probe = Experiment(cfg, tmp_path / "probe")  # the federation and model the run will use
    return Experiment.create(cfg, tmp_path / name, FailingExecutor(probe.fed, probe.model, fail))


@pytest.mark.long  # whole runs an algorithm: make test, not make test-fast
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_completes_rounds_without_the_failing_client(tmp_path, name):
    exp = _experiment(tmp_path, name, fail=[3])
    summary = exp.run(progress=False)
    assert summary["rounds_done"] == 4 and summary["accuracy"] is not None
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert all(r["dropped_clients"] in ([], [3]) for r in rows)
    assert sum(r["dropped"] for r in rows) >= 1, "client 3 is sampled at least once with this seed"
    assert torch.isfinite(exp.algorithm.global_model()).all()


def test_a_dropped_round_equals_the_round_without_that_client(tmp_path):
    cfg = configure.load(overrides=[*SMALL, "algorithm.name=fedavg"])
    probe = Experiment(cfg, tmp_path / "probe")
    sampled = probe.sample()  # round 1 of every run with this config samples these clients
    victim = sampled[0]
    exp = Experiment.create(cfg, tmp_path / "run", FailingExecutor(probe.fed, probe.model, [victim]))
    exp.run(progress=False, stop_after=1)
    ref = ALGORITHMS["fedavg"](ALGORITHMS["fedavg"].Params(), exp.algorithm.ctx)
    ref.round(1, sampled[1:], SequentialExecutor(exp.fed, exp.model).execute)
    assert torch.equal(ref.global_model(), exp.algorithm.global_model())
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["dropped"] == 1 and row["dropped_clients"] == [victim]


def test_an_evaluation_without_a_client_says_so(tmp_path, caplog):
    """A figure over fewer clients than asked is logged, naming the round and the client."""
    exp = _experiment(tmp_path, "fedavg", fail=[3])
    with caplog.at_level("WARNING", logger="stocfl"):
        summary = exp.run(progress=False)
    lines = [r.getMessage() for r in caplog.records]
    assert "round 4: evaluation: left out client 3: no reply" in lines, lines
    assert 3 not in exp.last_eval and summary["accuracy"] is not None
    # said in the files too, not in the log alone: the row, the summary, and a note from the command line
    rows = [json.loads(x) for x in (tmp_path / "fedavg" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_left_out"] == [3] and all("eval_left_out" not in r for r in rows if r["accuracy"] is None)
    assert summary["eval_left_out"] == [3]
    assert json.loads((tmp_path / "fedavg" / "summary.json").read_text())["eval_left_out"] == [3]
    assert summary["dropped_in_training"] == sum(r["dropped"] for r in rows) >= 1


def test_a_run_whose_clients_all_answer_has_no_left_out_keys(tmp_path):
    summary = _experiment(tmp_path, "fedavg", fail=[]).run(progress=False)
    assert "eval_left_out" not in summary and "dropped_in_training" not in summary


def test_held_out_clients_that_fail_are_named_and_an_empty_placement_has_no_accuracy():
    from stocfl.experiment.results import summarize_placements

    assert summarize_placements([], "x", [5, 7]) == {
        "clients": 0,
        "placement": "x",
        "accuracy": None,
        "would_open_new": 0,
        "left_out": [5, 7],
    }  # accuracy was 0.0


def test_the_command_line_notes_clients_left_out_of_the_final_evaluation(tmp_path, capsys):
    from stocfl.cli import _print_summary

    summary = {
        k: None
        for k in (
            "algorithm",
            "scenario",
            "dataset",
            "rounds_done",
            "accuracy",
            "global_accuracy",
            "n_clusters",
            "ari",
            "seconds",
        )
    }
    _print_summary(summary, tmp_path)
    assert "note" not in capsys.readouterr().err
    _print_summary({**summary, "eval_left_out": [3, 9]}, tmp_path)
    assert "leave out 2 client(s) that failed to answer the last evaluation (clients 3,9;" in capsys.readouterr().err


def test_a_log_line_groups_the_clients_that_failed_alike():
    from stocfl.client.tasks import grouped_reasons

    reasons = [f"client {i}: bad reply (loss = nan)" for i in (0, 1, 2, 5)] + [
        "client 3: no reply",
        "client 9 (node 4): timeout",
    ]
    assert grouped_reasons(reasons) == (
        "4 clients (0-2,5): bad reply (loss = nan); client 3: no reply; client 9 (node 4): timeout"
    )


@given(st.sets(st.integers(0, 60), min_size=1))
def test_id_ranges_lists_exactly_the_ids(ids):
    from stocfl.client.tasks import id_ranges

    back = set()
    for part in id_ranges(sorted(ids)).split(","):
        lo, _, hi = part.partition("-")
        back |= set(range(int(lo), int(hi or lo) + 1))
    assert back == ids
