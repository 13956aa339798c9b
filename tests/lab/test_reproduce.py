"""``stocfl reproduce`` and ``stocfl compare`` run declared sets of runs that survive a stop:
finished runs are reused only when their config is the one asked for, stopped ones resume to
the numbers of a run in one go, and the tables carry the paper's numbers beside ours."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.cli import main
from stocfl.devices import describe
from stocfl.errors import UserError
from stocfl.experiment import LoadedRun, configure
from stocfl.experiment.compare import run_or_reuse
from stocfl.experiment.loop import Experiment
from stocfl_lab.cli import main as lab_main
from stocfl_lab.reproduce import (
    authors_metric,
    draw_curves,
    listing,
    load_table,
    plot_curves,
    reproduce,
    table_files,
    tables,
)
from tests.helpers import REPO

pytestmark = pytest.mark.long  # whole runs on real data or the lab's tables (left out of make test-fast)

BASE = ["scenario.n_clients=8", "scenario.samples_per_client=20", "run.rounds=2", "run.sample_rate=0.5"]

TABLE = """
title = "A tiny table"
source = "a test"
config = "configs/tiny.toml"
seeds = [0]
notes = ["two rounds on digits"]

[[run]]
name = "FedAvg"
set = ["algorithm.name=fedavg"]
paper = [50.0, 1.0]

[[run]]
name = "StoCFL"
set = ["algorithm.name=stocfl"]
paper = [60.0, 2.0]
"""


def tiny_root(tmp_path: Path) -> Path:
    (tmp_path / "configs").mkdir(parents=True)
    (tmp_path / "configs" / "tiny.toml").write_text(
        "[scenario]\nn_clients = 8\nsamples_per_client = 20\n[run]\nrounds = 2\nsample_rate = 0.5\n"
    )
    root = tmp_path / "reproductions"
    root.mkdir()
    (root / "tiny.toml").write_text(TABLE)
    return root


def _rows(d: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k != "seconds"}
        for line in (d / "metrics.jsonl").read_text().splitlines()
    ]


def test_a_run_of_another_config_is_refused_the_same_reused_and_a_longer_one_extended(tmp_path):
    cfg = configure.load(None, BASE)
    first = run_or_reuse(cfg, tmp_path / "r", None, False)
    again = run_or_reuse(configure.load(None, BASE), tmp_path / "r", None, False)
    assert again == first
    with pytest.raises(UserError, match=r"holds a run of another config \(train.lr: 0.1 there, 0.2 asked\)"):
        run_or_reuse(configure.load(None, [*BASE, "train.lr=0.2"]), tmp_path / "r", None, False)
    longer = configure.load(None, [*BASE, "run.rounds=4"])
    assert run_or_reuse(longer, tmp_path / "r", None, False)["rounds_done"] == 4
    Experiment.create(longer, tmp_path / "whole").run(progress=False)
    assert _rows(tmp_path / "r") == _rows(tmp_path / "whole")


def test_resume_extends_a_finished_run_and_refuses_what_would_change_it(tmp_path, capsys):
    sets = [a for s in BASE for a in ("--set", s)]
    d = tmp_path / "r"
    assert main(["run", "--quiet", "--out", str(d), *sets]) == 0
    capsys.readouterr()
    assert main(["resume", "--quiet", str(d)]) == 0
    assert "has finished all 2 rounds; to run it further: stocfl resume" in capsys.readouterr().err
    assert len(_rows(d)) == 2
    for bad, says in (
        ("train.lr=0.2", "may change only run.rounds, run.eval_every"),
        ("run.rounds=1", "has done 2 rounds already"),
    ):
        assert main(["resume", "--quiet", str(d), "--set", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert main(["resume", "--quiet", str(d), "--set", "run.rounds=4"]) == 0
    whole = tmp_path / "whole"
    assert main(["run", "--quiet", "--out", str(whole), *sets, "--set", "run.rounds=4"]) == 0
    assert _rows(d) == _rows(whole)
    (d / "checkpoint.safetensors").unlink()
    assert main(["resume", "--quiet", str(d), "--set", "run.rounds=5"]) == 2
    assert "has no checkpoint" in capsys.readouterr().err


def test_a_table_is_written_with_the_papers_numbers_and_reused_on_a_second_call(tmp_path):
    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    fedavg, stocfl = doc["rows"]
    assert fedavg["status"] == stocfl["status"] == "done"
    assert fedavg["paper"] == {"mean": 50.0, "std": 1.0}
    assert fedavg["difference"] == pytest.approx(fedavg["ours"]["mean"] - 50.0, abs=0.011)
    assert json.loads((root / "tiny.json").read_text()) == doc
    md = (root / "tiny.md").read_text()
    assert "| StoCFL | accuracy | 60.00 +- 2.00 |" in md and "two rounds on digits" in md
    assert (root / "tiny.png").stat().st_size > 10_000  # the accuracy curves beside the table
    runs = sorted(p.name for p in (root / "runs" / "tiny").iterdir())
    assert runs == ["fedavg-seed0", "stocfl-seed0"]
    stamp = (root / "runs" / "tiny" / "fedavg-seed0" / "metrics.jsonl").stat().st_mtime_ns
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None)["rows"] == doc["rows"]
    assert (root / "runs" / "tiny" / "fedavg-seed0" / "metrics.jsonl").stat().st_mtime_ns == stamp  # reused


def test_a_finished_run_carried_without_its_checkpoint_still_makes_its_row(tmp_path):
    # reproductions/device.sh brings finished runs back from a device machine without their
    # checkpoints (a file that comes back holds at most 16 MiB)
    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    for d in (root / "runs" / "tiny").iterdir():
        (d / "checkpoint.safetensors").unlink()
    (root / "tiny.json").unlink()  # nothing recorded: the rows come from the run directories alone
    summary = root / "runs" / "tiny" / "stocfl-seed0" / "summary.json"
    assert json.loads(summary.read_text())["torch"] == torch.__version__
    summary.write_text(json.dumps({**json.loads(summary.read_text()), "torch": "2.11.0+cu130"}))  # run elsewhere
    again = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert [r["status"] for r in again["rows"]] == ["done", "done"]
    assert again["machine"].endswith(f"torch {'; '.join(sorted(['2.11.0+cu130', torch.__version__]))}")
    assert [r["ours"] for r in again["rows"]] == [r["ours"] for r in doc["rows"]]
    run_dir = root / "runs" / "tiny" / "fedavg-seed0"
    (run_dir / "summary.json").write_text(
        json.dumps({**json.loads((run_dir / "summary.json").read_text()), "rounds_done": 1})
    )
    (root / "tiny.json").unlink()
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["rows"][0][
        "status"
    ].startswith("stopped at round")


def test_a_fresh_clone_reuses_the_runs_its_table_records_and_reruns_a_changed_config(tmp_path):
    import shutil

    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    assert [len(r["runs"][0]["curves"]["accuracy"][0]) for r in doc["rows"]] == [2, 2]
    shutil.rmtree(root / "runs")  # the run directories are never committed; the table is
    png = (root / "tiny.png").read_bytes()
    again = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    assert again["rows"] == doc["rows"] and not (root / "runs").exists()  # nothing ran
    # a table written before runs were recorded: each row's one-seed mean is read back
    legacy = {**doc, "rows": [{k: v for k, v in r.items() if k != "runs"} for r in doc["rows"]]}
    (root / "tiny.json").write_text(json.dumps(legacy))
    old = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert [(r["ours"], r["authors_metric"], r["clusters"], r["seconds"], r["status"]) for r in old["rows"]] == [
        (r["ours"], r["authors_metric"], r["clusters"], r["seconds"], "done") for r in doc["rows"]
    ]
    assert (root / "tiny.png").read_bytes() == png  # no curves to draw: the PNG drawn with them stays
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None)["rows"] == old["rows"]
    # --rerun runs a recorded row again (here to draw its curves), the same numbers for the same seed
    redone = reproduce("tiny", root=root, progress=False, log=lambda m: None, rows="1", rerun=True)
    assert sorted(p.name for p in (root / "runs" / "tiny").iterdir()) == ["fedavg-seed0"]
    assert [len(r["runs"][0].get("curves") or {}) for r in redone["rows"]] == [2, 0]  # accuracy, n_clusters
    assert [(r["ours"], r["clusters"]) for r in redone["rows"]] == [(r["ours"], r["clusters"]) for r in doc["rows"]]
    assert lab_main(["reproduce", "tiny", "--rerun", "--report"]) == 2
    shutil.rmtree(root / "runs")
    (tmp_path / "configs" / "tiny.toml").write_text(
        "[scenario]\nn_clients = 8\nsamples_per_client = 20\n[run]\nrounds = 3\nsample_rate = 0.5\n"
    )
    longer = reproduce("tiny", root=root, progress=False, log=lambda m: None)  # recorded with a digest: rerun
    assert sorted(p.name for p in (root / "runs" / "tiny").iterdir()) == ["fedavg-seed0", "stocfl-seed0"]
    assert [len(r["runs"][0]["curves"]["accuracy"][0]) for r in longer["rows"]] == [3, 3]


def test_a_call_with_other_seeds_keeps_the_runs_the_table_records_for_the_rest(tmp_path):
    # --seeds 1 shows seed 1, but a fresh clone must still find seed 0's runs in TABLE.json:
    # losing them would make the next call run them again (hours, for the papers' tables)
    import shutil

    root = tiny_root(tmp_path)
    first = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    shutil.rmtree(root / "runs")  # a fresh clone: the table is the only record of seed 0
    one = reproduce("tiny", seeds=[1], root=root, progress=False, log=lambda m: None, rows="2")
    assert [r["seeds"] for r in one["rows"]] == [[], [1]]  # the table shows the seeds asked
    assert [[k["seed"] for k in r.get("other_runs", [])] for r in one["rows"]] == [[0], [0]]
    shutil.rmtree(root / "runs")
    ran: list[str] = []
    again = reproduce("tiny", root=root, progress=False, log=ran.append)
    assert not ran and not (root / "runs").exists()  # seed 0 read back from the table, nothing ran
    assert [(r["ours"], r["runs"]) for r in again["rows"]] == [(r["ours"], r["runs"]) for r in first["rows"]]
    assert [[k["seed"] for k in r.get("other_runs", [])] for r in again["rows"]] == [[], [1]]
    both = reproduce("tiny", seeds=[0, 1], root=root, progress=False, log=ran.append, report_only=True)
    assert [r["seeds"] for r in both["rows"]] == [[0], [0, 1]] and not ran
    assert all("other_runs" not in r for r in both["rows"])


def test_a_seed_given_twice_is_refused_not_counted_twice(tmp_path, capsys):
    # --seeds 0,0 showed seed 0's one run as n = 2 with a std of 0
    root = tiny_root(tmp_path)
    with pytest.raises(UserError, match=r"seeds \[0, 0\]: give distinct seeds"):
        reproduce("tiny", seeds=[0, 0], root=root, progress=False, log=lambda m: None, report_only=True)
    assert not (root / "tiny.json").exists()
    assert lab_main(["reproduce", "stocfl-tau-study", "--seeds", "0,1,0", "--report"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "stocfl-lab: error: --seeds '0,1,0': seed 0 is given twice; give distinct seeds, e.g. 0,1,2"
    ]
    (root / "tiny.toml").write_text(TABLE.replace("seeds = [0]", "seeds = [1, 1]"))
    with pytest.raises(UserError, match=r"tiny.toml: seeds = \[1, 1\]; give distinct seeds"):
        load_table("tiny", root)
    (root / "tiny.toml").write_text(TABLE.replace('"algorithm.name=fedavg"]', '"algorithm.name=fedavg", "run.seed=3"]'))
    with pytest.raises(UserError, match=r"row 'FedAvg' sets run.seed, which each seed's run sets itself"):
        load_table("tiny", root)  # it was silently replaced by each seed's own


def test_the_tables_date_is_its_runs_days_not_the_day_it_is_written_again(tmp_path):
    import calendar
    import shutil

    root = tiny_root(tmp_path)
    reproduce("tiny", root=root, progress=False, log=lambda m: None)
    for name, day in (("fedavg-seed0", "2026-01-05"), ("stocfl-seed0", "2026-01-02")):
        t = calendar.timegm(time.strptime(day + " 12", "%Y-%m-%d %H"))
        os.utime(root / "runs" / "tiny" / name / "summary.json", (t, t))
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert doc["date"] == "2026-01-02 to 2026-01-05"
    assert ", 2026-01-02 to 2026-01-05." in (root / "tiny.md").read_text().splitlines()[4]
    shutil.rmtree(root / "runs")  # a fresh clone: the dates come from the table
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["date"] == doc["date"]
    old = json.loads((root / "tiny.json").read_text())  # written before runs had dates: the table's day stays
    old["date"] = "2025-12-31"
    for row in old["rows"]:
        for run in row["runs"]:
            del run["date"]
    (root / "tiny.json").write_text(json.dumps(old))
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["date"] == "2025-12-31"


def test_a_recorded_run_that_fails_when_run_again_stays_recorded(tmp_path, data_dir):
    import shutil

    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace('set = ["algorithm.name=fedavg"]', 'set = ["algorithm.name=fedavg", "scenario.dataset=mnist"]')
    )
    first = reproduce("tiny", root=root, progress=False, log=lambda m: None, data_dir=str(data_dir))
    shutil.rmtree(root / "runs")
    (tmp_path / "no-data").mkdir()  # a directory, so the run starts, without MNIST's files, so it fails
    with pytest.raises(UserError, match=r"1 run\(s\) failed"):  # run again where the data are not
        reproduce(
            "tiny",
            root=root,
            progress=False,
            log=lambda m: None,
            rows="1",
            rerun=True,
            data_dir=str(tmp_path / "no-data"),
        )
    doc = json.loads((root / "tiny.json").read_text())
    assert doc["rows"][0]["status"].startswith("failed") and doc["rows"][0]["other_runs"] == first["rows"][0]["runs"]
    again = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert [(r["ours"], r["runs"], r["status"]) for r in again["rows"]] == [
        (r["ours"], r["runs"], "done") for r in first["rows"]
    ]


def test_a_stopped_runs_progress_is_recorded_and_outlives_its_run_directory(tmp_path):
    import shutil

    whole = reproduce("tiny", root=tiny_root(tmp_path / "a"), progress=False, log=lambda m: None)
    root = tiny_root(tmp_path / "b")
    cfg = configure.load(
        root.parent / "configs" / "tiny.toml",
        [*load_table("tiny", root).rows[1].overrides, "run.seed=0", "run.rounds=1"],
    )
    run_dir = root / "runs" / "tiny" / "stocfl-seed0"
    Experiment.create(cfg, run_dir).run(progress=False)  # a run of 1 round evaluates it ...
    (run_dir / "config.toml").write_text((run_dir / "config.toml").read_text().replace("rounds = 1", "rounds = 2"))
    (run_dir / "summary.json").unlink()  # ... and, its config asking 2, stopped there
    first = json.loads((run_dir / "metrics.jsonl").read_text())
    acc = first["accuracy"]
    said = f"stopped at round 1 of 2; accuracy {100 * acc:.2f} at round 1"
    row = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["rows"][1]
    assert row["status"] == said and row["ours"] == {}
    assert [
        {k: p[k] for k in ("seed", "rounds_done", "rounds", "measured_at", "accuracy", "curves")}
        for p in row["progress"]
    ] == [
        {
            "seed": 0,
            "rounds_done": 1,
            "rounds": 2,
            "measured_at": 1,
            "accuracy": acc,
            "curves": {"accuracy": [[1], [acc]], "n_clusters": [[1], [float(first["n_clusters"])]]},
        }
    ]
    assert f"| {said} |" in (root / "tiny.md").read_text()
    fig = draw_curves(load_table("tiny", root), {}, {"StoCFL": row["progress"]})
    dashed = [line for line in fig.axes[0].lines if line.get_linestyle() == "--"]
    assert [(line.get_label(), list(line.get_ydata())) for line in dashed] == [
        ("StoCFL (unfinished: seed 0, round 1 of 2)", [pytest.approx(100 * acc)])
    ]
    assert (root / "tiny.png").exists()  # drawn with it, though no run has finished
    shutil.rmtree(root / "runs")  # the machine that ran it is gone; its table is committed
    row = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["rows"][1]
    assert (
        row["status"] == f"{said} ({row['progress'][0]['date']}; its run directory is not here: it runs again "
        f"from round 1)"
    )
    assert listing(root).endswith("; 0 of 2 rows done, 1 stopped)")
    again = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    assert "progress" not in again["rows"][1] and [r["status"] for r in again["rows"]] == ["done", "done"]
    assert [r["ours"] for r in again["rows"]] == [r["ours"] for r in whole["rows"]]
    assert "progress" not in json.loads((root / "tiny.json").read_text())["rows"][1]


def test_recorded_progress_of_another_config_is_not_shown(tmp_path):
    root = tiny_root(tmp_path)
    run_dir = root / "runs" / "tiny" / "fedavg-seed0"
    cfg = configure.load(
        root.parent / "configs" / "tiny.toml", [*load_table("tiny", root).rows[0].overrides, "run.seed=0"]
    )
    Experiment.create(cfg, run_dir).run(progress=False, stop_after=1)
    row = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["rows"][0]
    assert row["status"].startswith("stopped at round 1 of 2") and row["progress"][0]["rounds_done"] == 1
    import shutil

    shutil.rmtree(root / "runs")
    conf = root.parent / "configs" / "tiny.toml"
    conf.write_text(conf.read_text() + "[train]\nlr = 0.2\n")  # the row's config changed since
    row = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)["rows"][0]
    assert row["status"] == "not run" and "progress" not in row


def test_a_row_that_cannot_run_here_is_marked_and_the_others_still_run(tmp_path):
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace(
            'set = ["algorithm.name=fedavg"]', 'set = ["algorithm.name=fedavg", "scenario.samples_per_client=5000"]'
        )
    )
    with pytest.raises(
        UserError,
        match=r"reproduce tiny: 1 run\(s\) failed, the table holds the rest .*first: FedAvg, "
        r"seed 0: config: .*samples_per_client",
    ):
        reproduce("tiny", root=root, progress=False, log=lambda m: None)
    doc = json.loads((root / "tiny.json").read_text())
    assert doc["rows"][0]["status"].startswith("failed: config: ") and doc["rows"][1]["status"] == "done"


def test_a_stopped_reproduction_resumes_to_the_numbers_of_one_in_one_go(tmp_path):
    whole = reproduce("tiny", root=tiny_root(tmp_path / "a"), progress=False, log=lambda m: None)
    root = tiny_root(tmp_path / "b")
    table = load_table("tiny", root)
    cfg = configure.load(table.config, [*table.rows[1].overrides, "run.seed=0"])
    Experiment.create(cfg, root / "runs" / "tiny" / "stocfl-seed0").run(progress=False, stop_after=1)  # a kill
    report = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert report["rows"][0]["status"] == "not run"
    assert re.fullmatch(r"stopped at round 1 of 2; accuracy \d+\.\d\d at round 1", report["rows"][1]["status"])
    assert listing(root).endswith("; 0 of 2 rows done, 1 stopped)")
    assert not (root / "runs" / "tiny" / "fedavg-seed0").exists()  # nothing ran
    resumed = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    for a, b in zip(whole["rows"], resumed["rows"]):
        assert (a["ours"], a["authors_metric"], a["clusters"]) == (b["ours"], b["authors_metric"], b["clusters"])


def test_rows_runs_the_rows_named_and_the_table_keeps_the_others_finished_runs(tmp_path):
    root = tiny_root(tmp_path)
    assert listing(root) == "tiny: A tiny table (2 runs per seed; seeds 0; not run yet)"
    first = reproduce("tiny", root=root, progress=False, log=lambda m: None, rows="2")
    assert [r["status"] for r in first["rows"]] == ["not run", "done"]
    assert listing(root).endswith("(2 runs per seed; seeds 0; 1 of 2 rows done)")
    assert not (root / "runs" / "tiny" / "fedavg-seed0").exists()
    assert re.search(r", (1 torch thread|\d+ torch threads) per run, torch ", first["machine"])  # the runs', not ours
    here = describe(torch.device("cpu"))  # each run records its processor: bits agree only on the same kind
    assert first["machine"].startswith(here + ", ") and first["rows"][1]["runs"][0]["processor"] == here
    then = reproduce("tiny", root=root, progress=False, log=lambda m: None, rows="1-1")
    assert [r["status"] for r in then["rows"]] == ["done", "done"]  # row 2's run is reported, not rerun
    assert then["rows"][1]["ours"] == first["rows"][1]["ours"]
    for bad in ("3", "0", "2-1", "x", "1,", "1-"):  # "1-" ran row 1 alone
        with pytest.raises(
            UserError,
            match=r"--rows .* not a row number or range of tiny's rows 1 to 2 "
            r"\(1: FedAvg; 2: StoCFL\)",
        ):
            reproduce("tiny", root=root, progress=False, log=lambda m: None, rows=bad)


def test_the_authors_metric_of_one_global_model_is_its_pooled_accuracy(tmp_path):
    # every client uses the global model and holds as many test samples as any other: the mean
    # over clients of its group's pooled accuracy is the accuracy pooled over all clients
    exp = Experiment.create(configure.load(None, [*BASE, "scenario.test_per_client=5"]), tmp_path / "r")
    summary = exp.run(progress=False)
    assert authors_metric(LoadedRun(exp)) == pytest.approx(summary["global_accuracy"], abs=1e-12)
    assert authors_metric(LoadedRun(exp), "pooled") == pytest.approx(summary["global_accuracy"], abs=1e-12)


def test_the_pooled_authors_metric_is_the_mean_over_cluster_models_of_each_on_all_test_data(tmp_path):
    import torch

    exp = Experiment.create(
        configure.load(None, [*BASE, "algorithm.name=ifca", "algorithm.n_models=3"]), tmp_path / "r"
    )
    exp.run(progress=False)
    parts = [exp.fed.test_data(i) for i in range(exp.fed.n_clients)]
    x, y = torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])
    models = exp.algorithm.cluster_models()
    plain = sum(float((exp.model.forward(w, x).argmax(1) == y).float().mean()) for w in models.values()) / len(models)
    assert len(models) == 3 and authors_metric(LoadedRun(exp), "pooled") == pytest.approx(plain, abs=1e-6)


def test_the_command_line_lists_tables_and_refuses_an_unknown_one(capsys):
    assert lab_main(["reproduce", "--list"]) == 0
    assert "stocfl-table1-4800x50: StoCFL Table 1" in capsys.readouterr().out
    assert "stocfl-table1-4800x50" in listing()
    assert lab_main(["reproduce", "no-such-table"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no table 'no-such-table'" in err


def test_a_malformed_table_gets_one_line(tmp_path):
    root = tiny_root(tmp_path)
    (root / "bad.toml").write_text('title = "x"\n[[run]]\nname = "a"\n')
    with pytest.raises(UserError, match=r"bad.toml: not a reproduction table \(KeyError"):
        load_table("bad", root)


def test_a_papers_number_without_a_spread_is_shown_without_one_and_three_numbers_are_refused(tmp_path):
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(TABLE.replace("paper = [50.0, 1.0]", "paper = [50.0]"))
    assert load_table("tiny", root).rows[0].paper == (50.0, None)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None, rows="1")
    assert doc["rows"][0]["paper"] == {"mean": 50.0, "std": None}
    assert "| FedAvg | accuracy | 50.00 |" in (root / "tiny.md").read_text()
    (root / "bad.toml").write_text(TABLE.replace("paper = [50.0, 1.0]", "paper = [50.0, 1.0, 2.0]"))
    with pytest.raises(UserError, match=r"expected \[mean, std\] or \[mean\]"):
        load_table("bad", root)


def test_the_compare_table_lists_every_finished_run_in_its_directory(tmp_path):
    from stocfl.experiment.compare import compare

    compare(None, ["fedavg"], [0], tmp_path, BASE, progress=False)
    rows = compare(None, ["stocfl"], [0, 1], tmp_path, BASE, progress=False)
    assert [(r["algorithm"], r["seeds"]) for r in rows] == [("stocfl", 2), ("fedavg", 1)]
    md = (tmp_path / "compare.md").read_text()
    assert "| stocfl | 2 |" in md and "| fedavg | 1 |" in md


def test_a_compare_directory_holds_runs_of_one_setting(tmp_path):
    # its table lists every run there: another lr or fewer rounds would be averaged under one label
    from stocfl.experiment.compare import compare

    compare(None, ["fedavg"], [0], tmp_path, BASE, progress=False)
    with pytest.raises(
        UserError,
        match=r"fedavg-seed0 holds a run of another setting \(train.lr: 0.1 there, 0.5 "
        r"asked\) and the table lists every run in",
    ):
        compare(None, ["fedavg"], [1], tmp_path, [*BASE, "train.lr=0.5"], progress=False)
    with pytest.raises(UserError, match=r"fedavg-seed0 holds a run of another setting \(run.rounds: 2 there, 3"):
        compare(None, ["stocfl"], [0], tmp_path, [*BASE, "run.rounds=3"], progress=False)
    with pytest.raises(
        UserError, match=r"--algo 'fedavg ' is given twice \(one row, fedavg\); give each algorithm once"
    ):
        compare(None, ["fedavg ", "stocfl", "fedavg"], [0], tmp_path, BASE, progress=False)  # was two equal rows
    with pytest.raises(UserError, match=r"--set 'run.seed=5': a comparison's seeds are given with --seeds"):
        compare(None, ["fedavg"], [0], tmp_path, [*BASE, "run.seed=5"], progress=False)  # was run at seed 0
    assert sorted(p.name for p in tmp_path.glob("*-seed*")) == ["fedavg-seed0"]  # refused before running
    rows = compare(None, ["fedavg", "stocfl"], [0, 1], tmp_path, [*BASE, "run.rounds=3"], progress=False)
    assert [(r["algorithm"], r["seeds"]) for r in rows] == [("fedavg", 2), ("stocfl", 2)]  # asked: extended


SWEEP = """
title = "clusters against tau"
source = "a test"
config = "configs/tiny.toml"
metric = "n_clusters"
sweep = "algorithm.tau"

[[run]]
name = "low"
set = ["algorithm.name=stocfl", "algorithm.tau=-0.9"]
paper = [1, 0]

[[run]]
name = "high"
set = ["algorithm.name=stocfl", "algorithm.tau=0.99"]

[[run]]
name = "global"
set = ["algorithm.tau=-0.9", "algorithm.name=stocfl"]
metric = "global_accuracy"
"""


def test_a_sweep_table_compares_the_measure_it_names(tmp_path):
    root = tiny_root(tmp_path)
    (root / "sweep.toml").write_text(SWEEP)
    doc = reproduce("sweep", root=root, progress=False, log=lambda m: None)
    low, high, glob = doc["rows"]
    assert (low["metric"], high["metric"], glob["metric"]) == ("n_clusters", "n_clusters", "global_accuracy")
    # clusters are counted, not scaled to percent; tau = -0.9 merges every pair it meets
    assert low["ours"]["mean"] == low["clusters"][0] == 1 and low["difference"] == 0.0
    assert high["ours"]["mean"] == high["clusters"][0] > 1 and high["paper"] is None
    # a row of another row's config reads that row's run: no second run of the same config
    assert sorted(p.name for p in (root / "runs" / "sweep").iterdir()) == ["high-seed0", "low-seed0"]
    summary = json.loads((root / "runs" / "sweep" / "low-seed0" / "summary.json").read_text())
    assert glob["ours"]["mean"] == round(100 * summary["global_accuracy"], 2)
    assert glob["authors_metric"] == {} and low["authors_metric"] == {}  # the authors' metric is of accuracy
    assert "| low | n_clusters | 1.00 +- 0.00 | 1.00 (n=1) | +0.00 |" in (root / "sweep.md").read_text()
    assert (root / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "bad, says",
    [
        (
            'metric = "loss"',
            "row 'low' has metric 'loss'; use one of accuracy, global_accuracy, macro_accuracy, heldout_accuracy, "
            "n_clusters, ari",
        ),
        ('sweep = "algorithm.lambda"', "row 'low' does not set algorithm.lambda, the key the table sweeps"),
    ],
)
def test_a_table_with_an_unknown_measure_or_an_unswept_row_gets_one_line(tmp_path, bad, says):
    root = tiny_root(tmp_path)
    text = SWEEP.replace('metric = "n_clusters"\nsweep = "algorithm.tau"', bad)
    (root / "sweep.toml").write_text(text)
    with pytest.raises(UserError, match=re.escape(says)):
        load_table("sweep", root)


def test_a_row_can_read_the_held_out_clients_of_its_run(tmp_path):
    root = tiny_root(tmp_path)
    (root / "unseen.toml").write_text(
        TABLE.replace(
            'set = ["algorithm.name=stocfl"]\npaper = [60.0, 2.0]',
            'set = ["scenario.holdout=0.5", "algorithm.name=fedavg"]\nmetric = "heldout_accuracy"\npaper = [60.0, 2.0]',
        )
    )
    doc = reproduce("unseen", root=root, progress=False, log=lambda m: None)
    summary = json.loads((root / "runs" / "unseen" / "stocfl-seed0" / "summary.json").read_text())
    assert summary["heldout"]["clients"] == 4  # one of each group's two
    assert doc["rows"][1]["ours"]["mean"] == round(100 * summary["heldout"]["accuracy"], 2)


def test_a_macro_row_reads_the_plain_mean_over_clients_from_the_run_its_micro_row_made(tmp_path):
    root = tiny_root(tmp_path)
    (root / "macro.toml").write_text(
        TABLE + '\n[[run]]\nname = "FedAvg, macro"\nset = ["algorithm.name=fedavg"]\nmetric = "macro_accuracy"\n'
    )
    doc = reproduce("macro", root=root, progress=False, log=lambda m: None)
    run = root / "runs" / "macro" / "fedavg-seed0"
    assert sorted(p.name for p in run.parent.iterdir()) == ["fedavg-seed0", "stocfl-seed0"]
    summary = json.loads((run / "summary.json").read_text())
    clients = [line.split(",") for line in (run / "clients.csv").read_text().splitlines()[1:]]
    accs = [float(c[5]) for c in clients if int(c[4]) > 0]
    sizes = [int(c[4]) for c in clients if int(c[4]) > 0]
    assert summary["macro_accuracy"] == pytest.approx(sum(accs) / len(accs), abs=1e-6)
    assert summary["accuracy"] == pytest.approx(sum(a * n for a, n in zip(accs, sizes)) / sum(sizes), abs=1e-6)
    micro, macro = doc["rows"][0], doc["rows"][2]
    assert macro["metric"] == "macro_accuracy" and macro["ours"]["mean"] == round(100 * summary["macro_accuracy"], 2)
    assert micro["ours"]["mean"] == round(100 * summary["accuracy"], 2)
    # a run finished before summary.json carried the figure: read from clients.csv
    summary.pop("macro_accuracy")
    (run / "summary.json").write_text(json.dumps(summary))
    again = reproduce("macro", root=root, progress=False, log=lambda m: None, report_only=True)
    assert again["rows"][2]["ours"]["mean"] == round(100 * sum(accs) / len(accs), 2)


def test_a_row_whose_run_another_row_finished_reads_done(tmp_path):
    """The macro row is not asked for, but the micro row's run is its run: once that run
    finishes, the table says done, not 'stopped at round 2' from the view before it finished."""
    root = tiny_root(tmp_path)
    (root / "macro.toml").write_text(
        TABLE + '\n[[run]]\nname = "FedAvg, macro"\nset = ["algorithm.name=fedavg"]\nmetric = "macro_accuracy"\n'
    )
    doc = reproduce("macro", root=root, progress=False, log=lambda m: None, rows="1")
    assert [r["status"] for r in doc["rows"]] == ["done", "not run", "done"]
    assert doc["rows"][2]["ours"]["n"] == 1
    assert "stopped" not in (root / "macro.md").read_text()


def test_a_row_can_read_its_measure_at_a_round_and_says_when_that_round_was_not_evaluated(tmp_path):
    root = tiny_root(tmp_path)
    (root / "rounds.toml").write_text(
        TABLE.replace(
            'set = ["algorithm.name=fedavg"]\npaper = [50.0, 1.0]',
            'set = ["algorithm.name=fedavg", "run.eval_every=1"]\nround = 1\npaper = [50.0, 1.0]',
        )
        + '\n[[run]]\nname = "FedAvg, last"\nset = ["run.eval_every=1", '
        '"algorithm.name=fedavg"]\npaper = [55.0, 1.0]\n'
    )
    doc = reproduce("rounds", root=root, progress=False, log=lambda m: None)
    assert sorted(p.name for p in (root / "runs" / "rounds").iterdir()) == ["fedavg-seed0", "stocfl-seed0"]
    rows = [
        json.loads(line)
        for line in (root / "runs" / "rounds" / "fedavg-seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = doc["rows"][0], doc["rows"][2]
    assert first["metric"] == "accuracy at round 1" and first["authors_metric"] == {}
    assert first["ours"]["mean"] == round(100 * rows[0]["accuracy"], 2)
    assert last["ours"]["mean"] == round(100 * rows[1]["accuracy"], 2) and last["metric"] == "accuracy"
    assert "| FedAvg | accuracy at round 1 | 50.00 +- 1.00 |" in (root / "rounds.md").read_text()
    (root / "late.toml").write_text(
        TABLE.replace(
            'set = ["algorithm.name=fedavg"]\npaper = [50.0, 1.0]',
            'set = ["algorithm.name=fedavg", "run.eval_every=2"]\nround = 1\npaper = [50.0, 1.0]',
        )
    )
    with pytest.raises(
        UserError,
        match=r"row 'FedAvg' reads round 1, which its runs do not evaluate \(run.eval_every = 2\); "
        r"add \"run.eval_rounds=\[1\]\" to its set",
    ):  # refused before it runs, not after
        reproduce("late", root=root, progress=False, log=lambda m: None)


def test_the_figure_draws_a_run_once_for_all_its_rows_and_grows_to_hold_a_long_legend(tmp_path):
    root = tiny_root(tmp_path)
    head = TABLE.split("[[run]]")[0]
    rows = "".join(
        f'[[run]]\nname = "M{i}, post cluster"\nset = ["x={i}"]\nround = 1\npaper = [50.0, 1.0]\n\n'
        f'[[run]]\nname = "M{i}, round 2"\nset = ["x={i}"]\npaper = [60.0, 1.0]\n\n'
        for i in range(30)
    )
    (root / "many.toml").write_text(head + rows)
    table = load_table("many", root)
    finished = {}
    for i in range(30):
        record = {"accuracy": 0.6, "rounds": 2, "curves": {"accuracy": [[1, 2], [0.5, 0.6 + i / 100]]}}
        finished[f"M{i}, post cluster"] = finished[f"M{i}, round 2"] = [record]
    fig = draw_curves(table, finished)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        *(f"M{i} (post cluster, round 2; 1 seed)" for i in range(30)),
        "the paper's number",
    ]
    curves = [line for line in ax.lines if len(line.get_xdata()) > 1]
    assert len(curves) == 30 and len({(c.get_color(), c.get_marker()) for c in curves}) == 30
    stars = sorted(
        (line.get_xdata()[0], line.get_ydata()[0])
        for line in ax.lines
        if line.get_marker() == "*" and len(line.get_xdata()) == 1
    )
    assert stars == [(1, 50.0)] * 30 + [(2, 60.0)] * 30  # each row's paper number at the round it reads
    fig.canvas.draw()
    legend, frame = ax.get_legend().get_window_extent(), fig.bbox
    assert fig.get_size_inches()[0] > 8.5 and frame.x0 <= legend.x0 and legend.x1 <= frame.x1 + 1
    assert frame.y0 - 1 <= legend.y0 and legend.y1 <= frame.y1 + 1  # the figure grew to hold 31 entries
    plot_curves(table, finished, root / "many.png")
    assert (root / "many.png").read_bytes()[1:4] == b"PNG"
    # a table without the paper's numbers has no star in its legend; a measure logged only at the
    # end (macro accuracy) is marked so, apart from a run whose curves were not recorded
    (root / "ours.toml").write_text(
        head + '[[run]]\nname = "A"\nset = ["x=1"]\n\n'
        '[[run]]\nname = "A, macro"\nset = ["x=1"]\nmetric = "macro_accuracy"\n\n'
        '[[run]]\nname = "B"\nset = ["x=2"]\n'
    )
    ran = {"accuracy": 0.6, "macro_accuracy": 0.5, "rounds": 2, "curves": {"accuracy": [[1, 2], [0.5, 0.6]]}}
    own = draw_curves(load_table("ours", root), {"A": [ran], "A, macro": [ran], "B": [{"accuracy": 0.7, "rounds": 2}]})
    assert [t.get_text() for t in own.axes[0].get_legend().get_texts()] == [
        "A (1 seed)",
        "A, macro: final value (measured at the last round only)",
        "B: final value (curve not recorded)",
    ]


def test_a_crowded_figure_splits_into_one_panel_a_row_group(tmp_path):
    # Table 3 draws 58 runs: one panel would be all legend; a panel a scenario, each titled with
    # it and its legend without it, keeps each curve readable. A table of few runs stays one panel.
    root = tiny_root(tmp_path)
    head = TABLE.split("[[run]]")[0]
    groups = ["Pathological", "Rotated", "Shifted", "Hybrid"]
    rows = "".join(
        f'[[run]]\nname = "{g}, lambda = {i}"\nset = ["x={g}{i}"]\npaper = [90.0, 0]\n\n'
        for g in groups
        for i in range(8)
    )
    (root / "groups.toml").write_text(head + rows)
    table = load_table("groups", root)
    finished = {
        r.name: [{"accuracy": 0.8, "rounds": 2, "curves": {"accuracy": [[1, 2], [0.5, 0.8]]}}] for r in table.rows
    }
    fig = draw_curves(table, finished)
    assert len(fig.axes) == 4
    for ax, g in zip(fig.axes, groups):
        assert ax.get_title(loc="left").endswith(g)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            *(f"lambda = {i} (1 seed)" for i in range(8)),
            "the paper's number",
        ]
        assert len([line for line in ax.lines if len(line.get_xdata()) > 1]) == 8
    assert fig.axes[0].get_title(loc="left").startswith("A tiny table")
    fig.canvas.draw()
    for ax in fig.axes:  # every legend inside the figure, every axes wider than its legend is long
        legend = ax.get_legend().get_window_extent()
        assert fig.bbox.x0 <= legend.x0 and legend.x1 <= fig.bbox.x1 + 1
        assert ax.get_window_extent().width > 0.3 * fig.bbox.width
    few = load_table("tiny", root)
    assert len(draw_curves(few, {r.name: finished["Rotated, lambda = 0"] for r in few.rows}).axes) == 1


@pytest.mark.parametrize("name", sorted(tables()))
def test_every_committed_table_loads_and_its_rows_are_valid_configs(name):
    # a typo in a row's overrides would otherwise first show after hours of the rows before it
    table = load_table(name)
    assert table.rows and table.config.exists()
    for row in table.rows:
        for extra in ([], list(table.quick)):
            cfg = configure.load(table.config, [*row.overrides, *extra])
            assert cfg.run.rounds >= 1
            assert row.at_round is None or row.at_round <= cfg.run.rounds, (row.name, extra)


@functools.cache
def papers_text() -> str | None:
    """The papers' text (../shared/papers), with the '+-' of its renderings made one form."""
    for d in (REPO.parent / "shared" / "papers", Path("/work/shared/papers")):
        if d.is_dir() and list(d.glob("*.txt")):
            text = "\n".join(f.read_text(errors="replace") for f in sorted(d.glob("*.txt")))
            return re.sub(r"\s*±\s*(plus-or-minus\\pm)?\s*", "±", text)
    return None


@pytest.mark.parametrize("name", sorted(tables()))
def test_every_papers_number_a_committed_table_prints_is_in_the_papers_text(name):
    # the paper column is printed beside ours as the paper's: a slip in copying it would make
    # every difference in that row wrong; a mean with its std must appear as the pair "mean±std".
    # A table whose numbers come from elsewhere (an official repository's README) quotes that
    # passage as source_text, and its numbers must appear in the quote.
    import tomllib

    quoted = tomllib.loads(tables()[name].read_text()).get("source_text")
    text = quoted or papers_text()
    if text is None:
        pytest.skip("the papers' text not found (../shared/papers)")
    for row in load_table(name).rows:
        if row.paper is None:
            continue
        mean, std = row.paper
        if std:  # as the paper prints it: two decimals, or fewer where it drops a zero (97.4±0.35)
            assert any(form in text for form in {f"{mean:.2f}±{std:.2f}", f"{mean:g}±{std:.2f}"}), (row.name, mean, std)
        else:
            assert any(
                re.search(rf"(?<![\d.]){re.escape(form)}(?![\d])", text) for form in {f"{mean:.2f}", f"{mean:g}"}
            ), (row.name, mean)


@pytest.mark.parametrize("name", sorted(tables()))
def test_every_run_a_committed_table_records_still_has_its_rows_digest(name):
    # a new config key that enters the digest at its default would make a fresh clone run every
    # recorded row again (runner.ADDED_KEYS keeps a key at its default out of the digest)
    from stocfl.experiment.provenance import config_digest
    from stocfl_lab.reproduce import table_files

    table = load_table(name)
    path = table_files(name)[1]
    if not path.exists():
        pytest.skip(f"{name} has not been run")
    entries = {e["name"]: e for e in json.loads(path.read_text())["rows"]}
    for row in table.rows:
        entry = entries.get(row.name, {})
        for rec in [*entry.get("runs", []), *entry.get("other_runs", [])]:
            cfg = configure.load(table.config, [*row.overrides, f"run.seed={rec['seed']}"])
            assert rec["digest"] == config_digest(cfg), (row.name, rec["seed"])


def test_a_reproduction_stopped_mid_table_keeps_the_later_rows_recorded_in_its_files(tmp_path):
    import shutil

    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    shutil.rmtree(root / "runs")  # a fresh clone: the table's record is all there is of the runs
    (root / "tiny.toml").write_text(
        TABLE.replace('"algorithm.name=fedavg"]', '"algorithm.name=fedavg", "train.lr=0.2"]')
    )

    def killed(message):  # the first row starts running, then the process dies
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reproduce("tiny", root=root, progress=False, log=killed)
    on_disk = json.loads((root / "tiny.json").read_text())
    assert [r["status"] for r in on_disk["rows"]] == [f"running seed 0 (pid {os.getpid()})", "done"]
    assert listing(root).endswith("; 1 of 2 rows done, 1 running)")
    assert on_disk["rows"][1]["runs"] == doc["rows"][1]["runs"]
    assert (
        f"| StoCFL | accuracy | 60.00 +- 2.00 | {doc['rows'][1]['ours']['mean']:.2f} (n=1) | "
        in (root / "tiny.md").read_text()
    )
    again = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert again["rows"][1]["runs"] == doc["rows"][1]["runs"] and again["rows"][0]["status"] == "not run"


def test_two_processes_on_other_rows_of_one_table_keep_each_others_runs(tmp_path):
    # this process runs row 2; while it runs, another process runs row 1 to the end. This
    # process passed row 1 while it was not run, yet its last table must hold the other's run
    import subprocess
    import sys

    root = tiny_root(tmp_path)
    other = (
        "from pathlib import Path; from stocfl_lab.reproduce import reproduce; "
        f"reproduce('tiny', root=Path({str(root)!r}), rows='1', progress=False, log=lambda m: None)"
    )

    def meanwhile(message):
        subprocess.run([sys.executable, "-c", other], check=True, timeout=300)

    doc = reproduce("tiny", root=root, progress=False, log=meanwhile, rows="2")
    on_disk = json.loads((root / "tiny.json").read_text())
    assert [r["status"] for r in doc["rows"]] == [r["status"] for r in on_disk["rows"]] == ["done", "done"]
    assert on_disk["rows"][0]["runs"][0]["seed"] == 0 and on_disk["rows"][0]["ours"]["n"] == 1
    assert "| FedAvg | accuracy | 50.00 +- 1.00 | " in (root / "tiny.md").read_text()
    assert "| FedAvg | accuracy | 50.00 +- 1.00 | - |" not in (root / "tiny.md").read_text()


def test_a_row_with_its_own_seeds_runs_those_and_is_done_only_when_all_are(tmp_path):
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace('set = ["algorithm.name=fedavg"]', 'set = ["algorithm.name=fedavg"]\nseeds = [0, 1, 2]')
    )
    assert listing(root).startswith("tiny: A tiny table (2 runs per seed; seeds 0, FedAvg: 0,1,2; ")
    reproduce("tiny", root=root, progress=False, log=lambda m: None, rows="2")
    first = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert [r["status"] for r in first["rows"]] == ["not run", "done"]
    reproduce("tiny", [0], root=root, progress=False, log=lambda m: None, rows="1")
    some = reproduce("tiny", root=root, progress=False, log=lambda m: None, report_only=True)
    assert some["rows"][0]["status"] == "1 of 3 seeds done; the rest not run" and some["rows"][0]["ours"]["n"] == 1
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    fedavg, stocfl = doc["rows"]
    assert fedavg["status"] == stocfl["status"] == "done"
    assert fedavg["seeds"] == [0, 1, 2] and stocfl["seeds"] == [0] and fedavg["ours"]["n"] == 3
    accs = [100 * r["accuracy"] for r in fedavg["runs"]]
    assert fedavg["ours"]["mean"] == pytest.approx(sum(accs) / 3, abs=0.006) and len(set(accs)) > 1  # seeds differ
    assert sorted(p.name for p in (root / "runs" / "tiny").iterdir()) == [
        "fedavg-seed0",
        "fedavg-seed1",
        "fedavg-seed2",
        "stocfl-seed0",
    ]
    assert doc["command"] == "stocfl-lab reproduce tiny" and doc["row_seeds"] == {"FedAvg": [0, 1, 2]}
    assert "(config `configs/tiny.toml`; seeds 0, FedAvg: 0,1,2), " in (root / "tiny.md").read_text()
    # --seeds still names every row's seeds: the rows' own are not run
    only = reproduce("tiny", [1], root=root, progress=False, log=lambda m: None, report_only=True)
    assert [r["seeds"] for r in only["rows"]] == [[1], []] and only["command"] == "stocfl-lab reproduce tiny --seeds 1"
    (root / "tiny.toml").write_text(
        TABLE.replace('set = ["algorithm.name=fedavg"]', 'set = ["algorithm.name=fedavg"]\nseeds = [1, 1]')
    )
    with pytest.raises(UserError, match=r"row 'FedAvg' has seeds = \[1, 1\]; give distinct seeds"):
        load_table("tiny", root)


def test_the_compare_table_says_when_a_figure_covers_fewer_seeds_or_clients():
    from stocfl.experiment.compare import COLUMNS, markdown

    row = {"algorithm": "x", "seeds": 2, "runs_with_clients_left_out": 0}
    for col in COLUMNS:
        row.update({f"{col}_mean": 0.5, f"{col}_std": 0.1, f"{col}_n": 2})
    assert "(n=" not in markdown([row]) and "left out" not in markdown([row])
    row.update(accuracy_n=1, runs_with_clients_left_out=1)  # one seed had no accuracy; one run left clients out
    md = markdown([row])
    assert "| x | 2 | 50.00 +- 10.00 (n=1) | 50.00 +- 10.00 |" in md
    assert "x: in 1 of its runs, clients that failed to answer the last evaluation are left out" in md


def test_rows_whose_data_this_call_lacks_are_refused_before_anything_runs(tmp_path, monkeypatch):
    from stocfl.data import datasets as data

    monkeypatch.delenv("STOCFL_DATA_DIR", raising=False)
    monkeypatch.setitem(data.DATASETS, "kept_elsewhere", (lambda d: data.load_dataset("digits"), True, False))
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace('"algorithm.name=stocfl"', '"algorithm.name=stocfl", "scenario.dataset=kept_elsewhere"')
    )
    for data_dir, says in (
        (None, "data set 'kept_elsewhere' needs a data directory"),
        (str(tmp_path / "gone"), "data directory .*gone does not exist"),
    ):
        with pytest.raises(UserError, match=rf"^reproduce tiny: row\(s\) 2 cannot run: {says}.*; nothing was run$"):
            reproduce("tiny", root=root, data_dir=data_dir, progress=False, log=lambda m: None)
        assert not (root / "tiny.json").exists() and not (root / "runs").exists()
    doc = reproduce("tiny", root=root, rows="1", progress=False, log=lambda m: None)  # row 1 needs none
    assert [r["status"] for r in doc["rows"]] == ["done", "not run"]
    (tmp_path / "data").mkdir()
    doc = reproduce("tiny", root=root, data_dir=str(tmp_path / "data"), progress=False, log=lambda m: None)
    assert [r["status"] for r in doc["rows"]] == ["done", "done"]
    assert reproduce("tiny", root=root, progress=False, log=lambda m: None) == doc  # finished runs need no data


def test_a_run_another_process_holds_is_left_to_it_not_marked_failed(tmp_path):
    import subprocess
    import sys

    root = tiny_root(tmp_path)
    run_dir = root / "runs" / "tiny" / "stocfl-seed0"
    run_dir.mkdir(parents=True)
    hold = (
        "import sys, time; from pathlib import Path; from stocfl.storage.files import exclusive\n"
        f"with exclusive(Path({str(run_dir)!r})):\n    print('held', flush=True); time.sleep(120)"
    )
    other = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        said = []
        doc = reproduce("tiny", root=root, progress=False, log=said.append)
    finally:
        other.kill()
        other.wait()
    assert [r["status"] for r in doc["rows"]] == ["done", f"running seed 0 (pid {other.pid})"]
    assert said[-1] == f"reproduce tiny: StoCFL, seed 0: another process (pid {other.pid}) is running it; left to it"
    assert [r["status"] for r in reproduce("tiny", root=root, progress=False, log=lambda m: None)["rows"]] == [
        "done",
        "done",
    ]


def test_the_command_line_refuses_empty_seeds_and_a_table_beside_list(capsys):
    # never a real table here: a regression would run it in the repository
    assert lab_main(["reproduce", "no-such-table", "--seeds", ""]) == 2
    assert "--seeds '': expected comma-separated integers" in capsys.readouterr().err
    assert lab_main(["reproduce", "--list", "no-such-table"]) == 2
    assert "drop 'no-such-table', or drop --list" in capsys.readouterr().err


PLAIN = REPO / "reproductions" / "plain_fedavg.py"


def _plain(*args: str) -> subprocess.CompletedProcess[str]:
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(PLAIN), *args], capture_output=True, text=True, timeout=300)


def test_plain_fedavg_reference_trains_one_domain(data_dir):
    """The plain-torch FedAvg that Table 3's lambda = 0 findings compare with learns MNIST, and says
    in one line (exit 2) when its input cannot give 100 clients x 600."""
    done = _plain("mnist", "--data-dir", str(data_dir), "--rounds", "1", "--per-round", "2")
    assert done.returncode == 0, done.stderr
    acc = float(re.search(r"round 1: ([\d.]+)%", done.stdout).group(1))
    assert 50 < acc <= 100
    bad = _plain("mnist", "--data-dir", str(data_dir), "--lr", "0")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "--lr > 0" in bad.stderr
    if not (data_dir / "fashion_mnist" / "train-images-idx3-ubyte.gz").is_file():
        few = _plain("fashion_mnist", "--data-dir", str(data_dir))
        assert few.returncode == 2 and len(few.stderr.strip().splitlines()) == 1
        assert "need 60,000" in few.stderr and "Traceback" not in few.stderr


def test_diagnostic_rows_are_shown_in_their_own_blocks_and_ours_carries_its_95_percent_interval(tmp_path):
    from scipy import stats

    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace("paper = [50.0, 1.0]", "paper = [50.0, 1.0]\nseeds = [0, 1, 2]")
        + '\n[[run]]\nname = "FedAvg, lr 0.2"\nset = ["algorithm.name=fedavg", "train.lr=0.2"]\n'
        'diagnostic = "a larger step"\npaper = [50.0, 1.0]\n'
    )
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    fedavg, stocfl_row, diag = doc["rows"]
    assert "diagnostic" not in fedavg and diag["diagnostic"] == "a larger step"
    values = [100 * r["accuracy"] for r in fedavg["runs"]]
    half = stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / np.sqrt(3)
    assert fedavg["ours"]["n"] == 3 and fedavg["ours"]["ci95"] == pytest.approx(half, abs=0.006)
    assert stocfl_row["ours"]["ci95"] is None  # one seed: no interval
    md = (root / "tiny.md").read_text()
    head, _, block = md.partition("Diagnostic rows, a larger step")
    assert "| FedAvg | accuracy |" in head and "| StoCFL |" in head and "FedAvg, lr 0.2" not in head
    assert "| FedAvg, lr 0.2 | accuracy |" in block.split("Notes:")[0]
    assert f"| {fedavg['ours']['mean']:.2f} ± {fedavg['ours']['ci95']:.2f} (n=3) |" in head


HEADLINE_SEEDS = 3  # issue 69: every headline row a reviewer reads runs over at least three seeds


@pytest.mark.parametrize("name", sorted(tables()))
def test_every_headline_row_a_reviewer_reads_declares_three_seeds(name):
    # the rows: each table's StoCFL and FedAvg rows, its best baseline, and every row that
    # differs from the paper by more than 2 points; the seeds not run yet read as pending
    table = load_table(name)
    record = json.loads(table_files(name)[1].read_text()) if table_files(name)[1].exists() else {"rows": []}
    recorded = {r["name"]: r for r in record["rows"]}
    headline = [r for r in table.rows if not r.diagnostic and r.paper is not None]
    ours = {r.name: (recorded.get(r.name) or {}).get("ours") or {} for r in headline}
    baselines = [
        r
        for r in headline
        if r.metric == "accuracy" and ours[r.name] and not any(k in r.name for k in ("StoCFL", "FedAvg"))
    ]
    # the best baseline of a table that compares methods with StoCFL (FL+HC's table compares FL+HC's settings)
    compared = any("StoCFL" in r.name for r in headline)
    best = max(baselines, key=lambda r: ours[r.name]["mean"]).name if baselines and compared else None
    for r in headline:
        diff = (recorded.get(r.name) or {}).get("difference")
        if "StoCFL" in r.name or "FedAvg" in r.name or r.name == best or (diff is not None and abs(diff) > 2):
            seeds = table.seeds_of(r)
            assert len(seeds) >= HEADLINE_SEEDS, f"{name}: row {r.name!r} declares seeds {list(seeds)}"


def test_a_row_reads_the_share_of_clients_reaching_its_target_at_a_round_and_at_the_end(tmp_path):
    import csv

    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.split("[[run]]")[0]
        + '[[run]]\nname = "FedAvg, clients at 40%"\nset = ["algorithm.name=fedavg", "run.target_accuracy=0.4"]\n'
        'metric = "clients_at_target"\npaper = [50.0, 0.0]\n\n'
        '[[run]]\nname = "FedAvg, clients at 40%, round 1"\n'
        'set = ["algorithm.name=fedavg", "run.target_accuracy=0.4"]\n'
        'metric = "clients_at_target"\nround = 1\npaper = [50.0, 0.0]\n'
    )
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    end, first = doc["rows"]
    run_dir = root / "runs" / "tiny" / "fedavg-clients-at-40-seed0"
    with open(run_dir / "clients.csv", newline="") as f:
        accs = [float(r["accuracy"]) for r in csv.DictReader(f) if int(r["test_samples"]) > 0]
    assert end["ours"]["mean"] == round(100 * sum(a >= 0.4 for a in accs) / len(accs), 2)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert first["ours"]["mean"] == round(100 * rows[0]["clients_at_target"], 2)
    # without a target the runs record none: refused in one line before anything runs
    (root / "tiny.toml").write_text((root / "tiny.toml").read_text().replace(', "run.target_accuracy=0.4"]', "]", 1))
    with pytest.raises(UserError, match=r"reads clients_at_target, which its runs record only with a target"):
        reproduce("tiny", root=root, progress=False, log=lambda m: None)


def test_clients_at_target_is_the_plain_share_of_clients_with_test_data_at_or_over_it():
    from types import SimpleNamespace

    from stocfl.experiment.results import clients_at

    ev = {
        i: SimpleNamespace(accuracy=a, n_samples=n)
        for i, (a, n) in enumerate([(0.99, 10), (0.98, 10), (1.0, 5), (0.0, 0)])
    }
    assert clients_at(ev, 0.99) == 2 / 3 and clients_at(ev, 1.0) == 1 / 3 and clients_at({}, 0.5) is None


def test_ifca_rows_say_how_many_models_each_seed_kept_and_since_which_round(tmp_path):
    from stocfl_lab.reproduce import models_in_use

    assert models_in_use({"curves": {"n_clusters": [[1, 2, 3, 4], [4, 3, 2, 2]]}}) == (2, 3)
    assert models_in_use({"curves": {"n_clusters": [[5, 10], [4, 4]]}}) == (4, 5)
    assert models_in_use({"curves": {}}) is None
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.replace(
            'name = "StoCFL"\nset = ["algorithm.name=stocfl"]',
            'name = "IFCA M=3"\nset = ["algorithm.name=ifca", "algorithm.n_models=3"]',
        )
    )
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    run = doc["rows"][1]["runs"][0]
    rows = [
        json.loads(line)
        for line in (root / "runs" / "tiny" / "ifca-m-3-seed0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert run["curves"]["n_clusters"] == [[r["round"] for r in rows], [float(r["n_clusters"]) for r in rows]]
    count, since = models_in_use(run)
    assert f"- IFCA M=3: seed 0: {count} from round {since}." in (root / "tiny.md").read_text()


def test_eval_rounds_evaluates_the_rounds_a_row_reads_with_the_numbers_of_evaluating_every_round(tmp_path):
    from stocfl.experiment.loop import Experiment as Exp

    every = Exp.create(configure.load(None, [*BASE, "run.rounds=4"]), tmp_path / "every")
    every.run(progress=False)
    sparse = Exp.create(
        configure.load(None, [*BASE, "run.rounds=4", "run.eval_every=3", "run.eval_rounds=[1, 2]"]), tmp_path / "sparse"
    )
    sparse.run(progress=False)
    a = [json.loads(x) for x in (tmp_path / "every" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "sparse" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in b if r["accuracy"] is not None] == [1, 2, 3, 4]
    sparse2 = Exp.create(
        configure.load(None, [*BASE, "run.rounds=4", "run.eval_every=4", "run.eval_rounds=[2]"]), tmp_path / "s2"
    )
    sparse2.run(progress=False)
    c = [json.loads(x) for x in (tmp_path / "s2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in c if r["accuracy"] is not None] == [2, 4]
    assert c[1]["accuracy"] == a[1]["accuracy"] and c[3]["accuracy"] == a[3]["accuracy"]


def test_a_row_reading_a_round_its_runs_do_not_evaluate_is_refused_before_any_run(tmp_path):
    root = tiny_root(tmp_path)
    (root / "tiny.toml").write_text(
        TABLE.split("[[run]]")[0]
        + '[[run]]\nname = "FedAvg, round 1"\nset = ["algorithm.name=fedavg", "run.eval_every=2"]\nround = 1\n'
        "paper = [50.0, 0.0]\n"
    )
    with pytest.raises(
        UserError,
        match=r"reads round 1, which its runs do not evaluate \(run.eval_every = 2\); "
        r'add "run.eval_rounds=\[1\]" to its set',
    ):
        reproduce("tiny", root=root, progress=False, log=lambda m: None)
    assert not (root / "runs").exists()


def test_pending_lists_each_declared_run_no_record_finishes_once_with_its_recorded_seeds_time(
    tmp_path, capsys, monkeypatch
):
    from stocfl_lab.reproduce import pending

    monkeypatch.delenv("STOCFL_DATA_DIR", raising=False)
    root = tiny_root(tmp_path)
    table = TABLE + '\n[[run]]\nname = "FedAvg, again"\nset = ["algorithm.name=fedavg"]\npaper = [50.0, 1.0]\n'
    (root / "tiny.toml").write_text(table)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    assert pending(root)[0] == []
    # three seeds declared for FedAvg: its two rows share one config, so seeds 1 and 2 are two runs, not four
    (root / "tiny.toml").write_text(
        table.replace('set = ["algorithm.name=fedavg"]\n', 'set = ["algorithm.name=fedavg"]\nseeds = [0, 1, 2]\n')
    )
    items, text = pending(root)
    took = doc["rows"][0]["runs"][0]["seconds"]
    assert [(i["row"], i["seed"], i["seconds"]) for i in items] == [("FedAvg", 1, took), ("FedAvg", 2, took)]
    assert text.endswith(
        "2 runs pending: 2 with a recorded time, about 0 hours in all as their recorded seeds took "
        "(0 of them measured on a GPU), 0 never run; the data they need not checked (pass --data-dir to check it)"
    )
    assert lab_main(["reproduce", "--pending", "--tables", str(root)]) == 0
    assert capsys.readouterr().out == text + "\n"
    # a finished run recorded without its curve (an older table's) is listed once, with the command
    # that runs it again; its two rows share it
    legacy = json.loads((root / "tiny.json").read_text())
    for row in legacy["rows"]:
        for run in row["runs"]:
            run["curves"] = None
    (root / "tiny.json").write_text(json.dumps(legacy))
    lines = pending(root)[1].splitlines()
    said = [x for x in lines if "without its curve" in x]
    assert len(said) == 2 and said[0].startswith("tiny: FedAvg, seed 0: recorded without its curve (it took ")
    assert said[0].endswith("); stocfl-lab reproduce tiny --rerun --rows 1 --seeds 0"), said
    assert lines[-1] == "2 finished runs recorded without their curves, about 0 hours to run again"
    assert not any("FedAvg, again, seed 0: recorded" in x for x in said)


def test_pending_with_a_data_directory_lists_apart_the_runs_its_data_cannot_build(tmp_path, capsys, monkeypatch):
    """A run whose data set the directory lacks, or whose scenario asks more samples than the
    data set holds (a partial Fashion-MNIST's case), cannot run there: with --data-dir it is
    said so, with the reason, and not counted among the runs to run; without it, the listing
    says the data were not checked."""
    from stocfl_lab.reproduce import pending

    monkeypatch.delenv("STOCFL_DATA_DIR", raising=False)
    root = tiny_root(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    rows = (
        '[[run]]\nname = "FedAvg, too many samples"\nset = ["algorithm.name=fedavg", '
        '"scenario.samples_per_client=1000"]\npaper = [50.0, 1.0]\n'
        '[[run]]\nname = "FedAvg on MNIST"\nset = ["algorithm.name=fedavg", "scenario.dataset=mnist"]\n'
        "paper = [50.0, 1.0]\n"
    )
    (root / "tiny.toml").write_text(TABLE + rows)
    unchecked = pending(root)[1].splitlines()
    assert unchecked[-1].startswith("4 runs pending: 0 with a recorded time") and "not checked" in unchecked[-1]
    items, text = pending(root, str(data))
    lines = text.splitlines()
    assert [i["row"] for i in items if not i.get("cannot")] == ["FedAvg", "StoCFL"]
    assert "2 runs pending: 0 with a recorded time, about 0 hours in all as their recorded seeds took " in text
    assert f"tiny: FedAvg, too many samples, seed 0: cannot run with {data}" in lines
    assert f"tiny: FedAvg on MNIST, seed 0: cannot run with {data}" in lines
    said = [x for x in lines if x.startswith("1 runs above cannot run with")]
    assert len(said) == 2, lines
    assert any("needs 2 clients x 1000" in x for x in said) and any("mnist" in x for x in said), said
    capsys.readouterr()
    assert lab_main(["reproduce", "--pending", "--tables", str(root), "--data-dir", str(data)]) == 0
    assert capsys.readouterr().out == text + "\n"


def test_a_rerun_that_gives_other_numbers_says_which_and_whether_the_machine_explains_it(tmp_path, capsys):
    import shutil

    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    shutil.rmtree(root / "runs")
    tampered = json.loads((root / "tiny.json").read_text())
    run = tampered["rows"][0]["runs"][0]
    here = (run["processor"], run["threads"])
    run.update(accuracy=0.123, processor="Another CPU, AVX2")
    (root / "tiny.json").write_text(json.dumps(tampered))
    capsys.readouterr()
    reproduce("tiny", root=root, progress=False, log=lambda m: None, rerun=True)  # both rows again, quietly
    out = capsys.readouterr().out
    first, second = (r["name"] for r in doc["rows"])
    said = [x for x in out.splitlines() if "WARNING" in x]
    assert len(said) == 1 and f"{first}, seed 0: WARNING run again under the same config, accuracy 0.123 -> " in said[0]
    assert f"recorded on Another CPU, AVX2 at {here[1]} torch threads, run again on {here[0]} at {here[1]}" in said[0]
    assert second not in out  # the same numbers again: nothing said


def test_a_rerun_of_a_migrated_record_compares_the_figures_it_holds_at_its_decimals(tmp_path, capsys):
    """A record migrated from an older table has no curves, figures rounded when written and
    none of the figures added since: run again, a rounded figure the run gives again is not
    flagged, one it does not give is said (at the record's decimals), a missing one is not."""
    import shutil

    from stocfl_lab.rerun import moved_as_recorded, recorded_places

    root = tiny_root(tmp_path)
    doc = reproduce("tiny", root=root, progress=False, log=lambda m: None)
    shutil.rmtree(root / "runs")
    legacy = json.loads((root / "tiny.json").read_text())
    first, second = (r["runs"][0] for r in legacy["rows"][:2])
    for run in (first, second):
        run.update(curves=None, processor=None, global_accuracy=None)
        run["accuracy"] = round(run["accuracy"], 3)  # as the older table wrote it
    first["accuracy"] = round(first["accuracy"] + 0.002, 3)  # a number the run will not give again
    (root / "tiny.json").write_text(json.dumps(legacy))
    capsys.readouterr()
    reproduce("tiny", root=root, progress=False, log=lambda m: None, rerun=True)
    said = [x for x in capsys.readouterr().out.splitlines() if "WARNING" in x]
    names = [r["name"] for r in doc["rows"]]
    acc = doc["rows"][0]["runs"][0]["accuracy"]
    assert len(said) == 1 and said[0].startswith(f"reproduce tiny: {names[0]}, seed 0: WARNING run again"), said
    assert f"accuracy {first['accuracy']} -> {acc} (compared at the 3 decimals it was recorded with)" in said[0]
    assert "recorded without its processor" in said[0] and "global_accuracy" not in said[0]
    # the rule itself: equal at the record's decimals, exact for counts, nothing for what it lacks
    held = {"accuracy": 0.794, "n_clusters": 4, "ari": None}
    assert (
        moved_as_recorded(held, {"accuracy": 0.79405, "n_clusters": 4, "ari": 0.5}, ["accuracy", "n_clusters", "ari"])
        == []
    )
    assert moved_as_recorded(held, {"accuracy": 0.7930, "n_clusters": 3}, ["accuracy", "n_clusters"]) == [
        "accuracy 0.794 -> 0.793 (compared at the 3 decimals it was recorded with)",
        "n_clusters 4 -> 3",
    ]
    # a percentage rounded to 87.07 and divided by 100 carries float noise: it holds 4 decimals
    noisy = {"accuracy": 87.07 / 100}
    assert repr(noisy["accuracy"]) == "0.8706999999999999"
    assert moved_as_recorded(noisy, {"accuracy": 0.87074}, ["accuracy"]) == []
    assert moved_as_recorded(noisy, {"accuracy": 0.870755}, ["accuracy"]) == [
        "accuracy 0.8707 -> 0.870755 (compared at the 4 decimals it was recorded with)"
    ]
    assert [recorded_places(x) for x in (0.5, 0.794, 1.0, 0.123456789, 2.0 / 3.0)] == [1, 3, 0, 9, 16]


@settings(max_examples=300, deadline=None)
@given(v=st.floats(0, 1), places=st.integers(0, 9), percent=st.booleans())
def test_a_rounded_figure_holds_no_more_decimals_than_it_was_rounded_to(v, places, percent):
    """A figure rounded to p decimals (or a percentage rounded to p - 2 and divided by 100, as
    older tables were migrated) reads as holding at most p decimals, and is itself at them."""
    from stocfl_lab.rerun import recorded_places

    x = round(v * 100, places - 2) / 100 if percent and places >= 2 else round(v, places)
    p = recorded_places(x)
    assert p <= places and round(x, p) == round(x, places)


def _set_first_run(field, value):
    return lambda doc: next(r for r in doc["rows"] if r["runs"])["runs"][0].__setitem__(field, value)


@pytest.mark.parametrize(
    "corrupt, says",
    [
        (lambda doc: "{not json", "is unreadable"),
        (lambda doc: doc.update(rows={"a": 1}), "is not a reproduction table (no list of 'rows')"),
        (lambda doc: doc.update(table="stocfl-table3-lambda"), "records table 'stocfl-table3-lambda'"),
        (lambda doc: doc["rows"].append(["a row"]), "is not a table of fields with a name"),
        (
            lambda doc: next(r for r in doc["rows"] if r["runs"]).update(runs={"a": 1}),
            "where it must be a list of runs",
        ),
        (lambda doc: next(r for r in doc["rows"] if r["runs"])["runs"].append(7), "that is not a table of fields (7)"),
        (lambda doc: [next(r for r in doc["rows"] if r["runs"])["runs"][0].pop("digest"), None][1], "without 'digest'"),
        (_set_first_run("accuracy", "high"), 'with accuracy = "high", where it must be a number or null'),
        (_set_first_run("accuracy", float("nan")), "with accuracy = NaN"),
        (_set_first_run("seed", "0"), 'with seed = "0", where it must be an integer'),
        (_set_first_run("seconds", -3), "with seconds = -3, where it must be a number of seconds"),
        (_set_first_run("n_clusters", 2.5), "with n_clusters = 2.5, where it must be an integer or null"),
        (_set_first_run("curves", {"accuracy": [[10, 20], [0.5]]}), "[rounds, values] of one length"),
    ],
)
def test_a_damaged_table_record_is_one_line_and_never_read_as_nothing(tmp_path, capsys, corrupt, says):
    """A table's JSON that cannot be read, is another table's or records a run with a field
    missing or of the wrong kind: one line naming the file, the row and the field (exit 2), for
    --report and a run alike. Read as nothing, as it was, its runs would be run again and the file
    written over; a run of the wrong kind was a traceback or silently left out."""
    import shutil

    name = "stocfl-table1-1200x200"
    root = tmp_path / "reproductions"
    root.mkdir()
    shutil.copy(REPO / "reproductions" / f"{name}.toml", root)
    doc = json.loads((REPO / "reproductions" / f"{name}.json").read_text())
    text = corrupt(doc)
    (root / f"{name}.json").write_text(text if isinstance(text, str) else json.dumps(doc))
    before = (root / f"{name}.json").read_text()
    for args in (["--report"], ["--rows", "1"]):
        capsys.readouterr()
        assert lab_main(["reproduce", name, "--tables", str(root), "--quiet", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{name}.json" in err and says in err, err
    assert (root / f"{name}.json").read_text() == before, "the damaged file is left as it was"
    assert not (root / "runs").exists(), "nothing ran"
    if "records table" not in says:  # the coverage page reads the rows of any table it names
        from stocfl_lab.coverage import _table_rows

        with pytest.raises(UserError, match=re.escape(says)):
            _table_rows(root, name)
    capsys.readouterr()
    assert lab_main(["reproduce", "--list", "--tables", str(root)]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"{name}: "))
    damaged = "its record is table 'stocfl-table3-lambda''s" if "records table" in says else "its record is damaged"
    assert line.endswith(f"{damaged} (stocfl-lab reproduce TABLE --report says how))"), line
