"""The clustered-FL benchmark (``stocfl-lab benchmark``): the quick grid end to end, its record
reused on a fresh clone, shards and merges, the statistics against plain computations, the
traffic counted from the tasks and replies, and a bad grid in one line."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from scipy import stats

from stocfl_lab.benchmark import load_grid, mean_ci, ranks
from stocfl_lab.cli import main as lab
from tests.helpers import REPO

GRID = REPO / "benchmark" / "grid.toml"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """The quick grid run once into a directory of its own."""
    d = tmp_path_factory.mktemp("bench")
    shutil.copy(GRID, d / "grid.toml")
    assert lab(["benchmark", "--grid", str(d / "grid.toml"), "--quick", "--quiet", "--out", str(d / "quick.md")]) == 0
    return d


def test_the_quick_grid_records_every_run_and_writes_the_leaderboard(quick, capsys):
    grid = load_grid(quick / "grid.toml")
    cells = grid.cells(quick=True)
    record = json.loads((quick / "BENCHMARK-quick.json").read_text())["runs"]
    assert len(record) == len(cells) * len(grid.seeds_for(True)) == 12
    for entry in record.values():
        f = entry["figures"]
        assert 0 <= f["accuracy"] <= 1 and f["bytes_down_per_round"] > 0 and f["bytes_up_per_round"] > 0
        assert len(entry["digest"]) == 64 and entry["curve"][-1][0] == 20
    text = (quick / "quick.md").read_text()
    for cell in cells:
        assert f"| {cell.key} |" in text, cell.key
    assert "| *pending*" not in text and "Nemenyi's critical difference" in text
    # run again: every run reused, none run; a fresh clone (no run directories) reuses them too
    capsys.readouterr()
    shutil.rmtree(quick / "runs")
    assert lab(["benchmark", "--grid", str(quick / "grid.toml"), "--quick", "--quiet"]) == 0
    assert "0 runs run, 12 reused" in capsys.readouterr().out


def test_shards_split_the_cells_and_merge_into_the_whole(quick, tmp_path, capsys):
    for i in (0, 1):
        d = tmp_path / f"shard{i}"
        d.mkdir()
        shutil.copy(GRID, d / "grid.toml")
        assert lab(["benchmark", "--grid", str(d / "grid.toml"), "--quick", "--quiet", "--shard", f"{i}/2"]) == 0
    capsys.readouterr()
    keys = [set(json.loads((tmp_path / f"shard{i}" / "BENCHMARK-quick.json").read_text())["runs"]) for i in (0, 1)]
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    whole = set(json.loads((quick / "BENCHMARK-quick.json").read_text())["runs"])
    assert keys[0] | keys[1] == whole
    merged = tmp_path / "shard0" / "BENCHMARK-quick.json"
    assert (
        lab(
            [
                "benchmark",
                "--grid",
                str(tmp_path / "shard0" / "grid.toml"),
                "--quick",
                "--record",
                str(merged),
                "--merge",
                str(tmp_path / "shard1" / "BENCHMARK-quick.json"),
            ]
        )
        == 0
    )
    assert set(json.loads(merged.read_text())["runs"]) == whole
    # a run recorded under another config is refused, not mixed in
    other = json.loads((tmp_path / "shard1" / "BENCHMARK-quick.json").read_text())
    key = next(iter(other["runs"]))
    other["runs"][key]["digest"] = "0" * 64
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert (
        lab(
            [
                "benchmark",
                "--grid",
                str(GRID),
                "--quick",
                "--record",
                str(merged),
                "--merge",
                str(tmp_path / "other.json"),
            ]
        )
        == 2
    )
    assert "has another config" in capsys.readouterr().err


def test_fedavg_traffic_is_the_model_down_and_up_for_every_sampled_client(tmp_path):
    """Counted from the tasks and replies: FedAvg sends each sampled client the model and gets a
    model back, so a round is m x P x 4 bytes each way."""
    import stocfl

    result = stocfl.run({"run": {"rounds": 3, "sample_rate": 0.25}, "algorithm": {"name": "fedavg"}}, progress=False)
    exp_p = sum(v.numel() for v in result.models["global"].values())
    m = round(0.25 * 40)
    for row in result.metrics:
        assert row["bytes_down"] == row["bytes_up"] == m * exp_p * 4, (row["bytes_down"], m, exp_p)


@pytest.mark.parametrize("values", [[0.5], [0.1, 0.2], [0.3, 0.31, 0.35, 0.5, 0.2]])
def test_mean_and_confidence_interval_are_students(values):
    mean, ci = mean_ci(values)
    assert math.isclose(mean, np.mean(values))
    if len(values) == 1:
        assert ci is None
    else:
        want = stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / math.sqrt(len(values))
        assert math.isclose(ci, want)


def test_ranks_share_ties_and_give_friedman_and_the_critical_difference():
    def cell(m, s, acc):
        return {"method": m, "scenario": s, "participation": 0.1, "runs": [{"figures": {"accuracy": acc}}]}

    cells = {
        f"{m}/{s}": cell(m, s, a)
        for s, accs in {"x": (0.9, 0.8, 0.7), "y": (0.9, 0.9, 0.5), "z": (0.6, 0.7, 0.8)}.items()
        for m, a in zip("abc", accs)
    }
    got = ranks(cells, ["a", "b", "c"])
    assert got["pairs"] == 3 and got["mean_rank"] == {
        "a": round((1 + 1.5 + 3) / 3, 3),
        "b": round((2 + 1.5 + 2) / 3, 3),
        "c": round((3 + 3 + 1) / 3, 3),
    }
    q = stats.studentized_range.ppf(0.95, 3, np.inf) / math.sqrt(2)
    assert math.isclose(got["cd"], q * math.sqrt(3 * 4 / 18))
    assert 0 < got["friedman_p"] <= 1


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda t: t.replace('name = "cfl"', 'name = "nope"'), "unknown method 'nope'"),
        (lambda t: t.replace('name = "cfl"', 'name = "fedavg"'), "method 'fedavg' is declared twice"),
        (lambda t: t.replace('family = "mixtures"\n', "", 1), "KeyError"),
        (lambda t: t + "\n[[method]\n", "cannot be read"),
    ],
)
def test_a_bad_grid_is_one_line(tmp_path, capsys, edit, says):
    (tmp_path / "grid.toml").write_text(edit(GRID.read_text()))
    assert lab(["benchmark", "--grid", str(tmp_path / "grid.toml"), "--page"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    assert lab(["benchmark", "--grid", str(GRID), "--page", "--shard", "3/2"]) in (0, 2)


def test_the_committed_leaderboard_is_what_the_record_gives():
    """docs/benchmark.md is written from benchmark/BENCHMARK.json by one command
    (stocfl-lab benchmark --page --out docs/benchmark.md): it never drifts from the record."""
    from stocfl_lab.benchmark import page, read_record

    assert (REPO / "docs" / "benchmark.md").read_text() == page(
        load_grid(GRID), read_record(REPO / "benchmark" / "BENCHMARK.json")
    ), "run: stocfl-lab benchmark --page --out docs/benchmark.md"
