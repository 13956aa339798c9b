"""``stocfl-lab bench --tables``: a real table's declared setting timed against its bound, the
JSON kept table by table, and bad arguments refused in one line."""

from __future__ import annotations

import json

import pytest

from stocfl_lab.cli import main


def test_a_table_is_timed_against_its_arithmetic_and_kept(data_dir, tmp_path, capsys, monkeypatch):
    from stocfl.executors.parallel import ParallelExecutor

    closed = []
    close = ParallelExecutor.close
    monkeypatch.setattr(ParallelExecutor, "close", lambda self: closed.append(1) or close(self))
    out = tmp_path / "tables.json"
    args = ["bench", "--tables", "--table", "stocfl-fig3-clustering", "--rounds", "1", "--data-dir", str(data_dir)]
    assert main([*args, "--out", str(out)]) == 0
    got = json.loads(out.read_text())["tables"]["stocfl-fig3-clustering"]
    # its workers (and the memory they hold) end with the table, not when the collector finds them
    assert closed == ([1] if got["engine"] == "parallel" else [])
    (r,) = got["per_round"]
    assert r["gflop"] > 0 and r["seconds"] > 0 and got["matmul_peak_gflops"] > 0
    # seconds / (FLOPs / peak), from the figures it prints
    assert got["over_bound"] == pytest.approx(
        r["seconds"] / (r["gflop"] * 1e9 / (got["matmul_peak_gflops"] * 1e9)), rel=0.02
    )
    capsys.readouterr()
    assert main([*args, "--out", str(out)]) == 0  # kept, not timed again
    assert "stocfl-fig3-clustering: kept" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["bench", "--tables", "--table", "no-such-table"], "no table 'no-such-table'"),
        (["bench", "--tables", "--rounds", "0"], "--rounds must be >= 1"),
        (["bench", "--rounds", "2"], "add --tables"),
    ],
)
def test_bad_arguments_are_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err


@pytest.mark.parametrize(
    "text, says",
    [
        ("{not json", "is unreadable"),
        ("[1, 2]", "is not a table bench's results"),
        ('{"tables": {"t": {"rounds": "2", "date": "2026-12-06"}}}', "table 't' has no whole entry"),
        ('{"tables": {"t": 5}}', "table 't' has no whole entry"),
    ],
)
def test_a_damaged_results_file_is_one_line_before_anything_is_timed(tmp_path, capsys, text, says):
    out = tmp_path / "tables.json"
    out.write_text(text)
    assert main(["bench", "--tables", "--table", "stocfl-fig3-clustering", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and str(out) in err and "\n" not in err
    assert out.read_text() == text


def test_the_rounds_are_timed_in_one_run_as_a_real_run_s(data_dir, tmp_path, monkeypatch):
    """A run that stops gives back what its engine keeps from round to round (the chunk pool,
    the freed memory): rounds timed one stop at a time each paid for fresh pages a real run
    pays for once. One run, then each round's own tasks and FLOPs, and the figures from the
    second round on."""
    from stocfl.experiment import Experiment

    calls = []
    run = Experiment.run

    def counted(self, *a, **kw):
        calls.append(kw.get("stop_after"))
        return run(self, *a, **kw)

    monkeypatch.setattr(Experiment, "run", counted)
    out = tmp_path / "tables.json"
    args = ["bench", "--tables", "--table", "stocfl-table3-lambda", "--rounds", "2", "--data-dir", str(data_dir)]
    assert main([*args, "--out", str(out)]) == 0
    assert calls == [2]
    got = json.loads(out.read_text())["tables"]["stocfl-table3-lambda"]
    assert [r["round"] for r in got["per_round"]] == [1, 2]
    assert all(r["gflop"] > 0 and r["lowrank_gflop"] > 0 for r in got["per_round"])
    second = got["per_round"][1]
    assert got["steady_seconds_per_round"] == second["seconds"]
    assert got["steady_over_lowrank_bound"] == pytest.approx(second["over_lowrank_bound"], rel=0.02)


def test_a_table_whose_round_does_not_fit_in_memory_is_said_and_recorded_not_timed(
    data_dir, tmp_path, monkeypatch, capsys
):
    from stocfl.executors import base

    monkeypatch.setattr(base, "available_bytes", lambda at_least=0: 0)  # a machine with no room for any reply
    out = tmp_path / "tables.json"
    args = ["bench", "--tables", "--table", "stocfl-table3-lambda", "--rounds", "1", "--data-dir", str(data_dir)]
    assert main([*args, "--out", str(out)]) == 0
    got = json.loads(out.read_text())["tables"]["stocfl-table3-lambda"]
    assert "client trainings return" in got["not_timed"] and got["rounds"] == 1 and got["date"]
    assert "stocfl-table3-lambda: not timed: this round's" in capsys.readouterr().err
