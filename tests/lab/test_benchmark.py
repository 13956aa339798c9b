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

from stocfl.experiment import configure, finished_summary, run_or_reuse, shed_state
from stocfl.experiment.loop import Experiment
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
        assert f["flops_per_round"] > 0 and entry["cpu_seconds"] > 0 and entry["figures_version"] == 2
        assert entry["load_average"] >= 0 and entry["cores"] >= 1
        assert len(entry["digest"]) == 64 and entry["curve"][-1][0] == 20
    text = (quick / "quick.md").read_text()
    for cell in cells:
        assert f"| {cell.key} |" in text, cell.key
    for s in grid.quick["scenarios"]:  # a figure per (scenario, participation), linked from the page
        name = f"figures/benchmark-quick/{s}-p0.5.png"
        assert (quick / name).read_bytes()[:4] == b"\x89PNG" and f"]({name})" in text
    assert "| *pending*" not in text and "Nemenyi's critical difference" in text
    # each recorded run keeps its results files, not its state
    for d in (quick / "runs").glob("*/*/*/seed*"):
        assert finished_summary(d) is not None and (d / "metrics.jsonl").exists() and (d / "clients.csv").exists()
        assert not (d / "checkpoint.safetensors").exists(), d
    assert len(list((quick / "runs").glob("*/*/*/seed*"))) == 12
    # run again: every run reused, none run; a fresh clone (no run directories) reuses them too
    capsys.readouterr()
    shutil.rmtree(quick / "runs")
    assert lab(["benchmark", "--grid", str(quick / "grid.toml"), "--quick", "--quiet"]) == 0
    assert "0 runs run, 12 reused" in capsys.readouterr().out


@pytest.mark.parametrize("ram", ["0", "1000000000"], ids=["mapped", "journal"])
def test_a_finished_runs_state_is_shed_and_it_is_still_reused_with_its_numbers(tmp_path, ram):
    """Ditto with its personal models beyond run.store_ram (a mapped file, an undo log) or within
    it (a journal): shedding the finished run's state leaves its results, and the run is read as
    finished (not run again, not resumed) with the same summary; a stopped run's state, what
    resumes it, is kept."""
    sets = ["scenario.n_clients=12", "scenario.samples_per_client=20", "run.rounds=3", "algorithm.name=ditto"]
    cfg = lambda: configure.load(overrides=[*sets, f"run.store_ram={ram}"])  # noqa: E731
    done, stopped = tmp_path / "done", tmp_path / "stopped"
    summary = Experiment.create(cfg(), done).run(progress=False)
    assert Experiment.create(cfg(), stopped).run(progress=False, stop_after=2) is None
    # the store's files by what they are, not by the names the library gives them
    state = [f.name for f in done.iterdir() if f.name.startswith("ditto") or f.name == "checkpoint.safetensors"]
    assert "checkpoint.safetensors" in state and any(n.startswith("ditto") for n in state), state
    kept = {f.name: f.read_bytes() for f in done.iterdir() if f.is_file() and f.name not in state}
    before = sorted(f.name for f in stopped.iterdir())
    assert shed_state(done) > 0 and shed_state(stopped) == 0
    assert sorted(f.name for f in stopped.iterdir()) == before
    assert {f.name: f.read_bytes() for f in done.iterdir() if f.is_file()} == kept
    assert run_or_reuse(cfg(), done, None, False) == summary == finished_summary(done)
    assert {f.name: f.read_bytes() for f in done.iterdir() if f.is_file()} == kept, "read, not run again"


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


def test_a_run_another_process_holds_is_left_to_it_and_the_rest_run(tmp_path, capsys):
    """Two runners whose cells overlap: a run whose directory another process holds is left to
    that process (one line naming it), and the runner goes on with the other runs."""
    import subprocess
    import sys

    import stocfl
    from stocfl_lab.benchmark import FIGURES_VERSION, jobs

    shutil.copy(GRID, tmp_path / "grid.toml")
    grid, only = load_grid(tmp_path / "grid.toml"), "fedavg / rotated-digits / 0.5"
    first = jobs(grid, "default", {"runs": {}}, tmp_path / "runs", True, None, only)[0][0]
    held = first.out.with_name(f"{first.out.name}-{stocfl.config_digest(first.cfg)[:10]}-f{FIGURES_VERSION}")
    held.mkdir(parents=True)
    hold = (
        "import sys, time\nfrom stocfl.storage import exclusive\n"
        "with exclusive(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(held)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert lab(["benchmark", "--grid", str(tmp_path / "grid.toml"), "--quick", "--quiet", "--only", only]) == 0
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr().out
    said = f"{held.resolve()} is in use by another process (pid {holder.pid})"
    assert f"{first.key}: left to the process that holds it ({said}" in out
    assert "1 runs run, 0 reused, 1 left to other processes that hold them" in out
    record = json.loads((tmp_path / "BENCHMARK-quick.json").read_text())["runs"]
    assert first.key not in record and len(record) == 1


def test_a_run_recorded_under_a_config_the_grid_no_longer_asks_is_not_shown_and_runs_again(quick, tmp_path, capsys):
    """A scenario's settings changed after its runs were recorded: the page shows none of their
    numbers (the scenario's cells pending, the runs named as to run again, the cost counting
    them), `benchmark` runs them anew under the new config, and the other cells keep theirs."""
    from stocfl_lab.benchmark import asked, page, read_record

    d = tmp_path / "changed"
    d.mkdir()
    before = '"scenario.name=rotated", "scenario.dataset=digits", "scenario.samples_per_client=30"'
    text = GRID.read_text()
    assert text.count(before) == 1
    (d / "grid.toml").write_text(text.replace(before, before.replace("=30", "=24")))
    shutil.copy(quick / "BENCHMARK-quick.json", d / "BENCHMARK-quick.json")
    grid, record = load_grid(d / "grid.toml"), read_record(d / "BENCHMARK-quick.json")
    assert asked(load_grid(GRID), record, quick=True)["stale"] == []  # the grid they were run for: all shown
    view = asked(grid, record, quick=True)
    assert len(view["stale"]) == 6 and all(" / rotated-digits / " in k for k in view["stale"])
    assert len(view["runs"]) == 6 and not any(" / rotated-digits / " in k for k in view["runs"])
    shown = page(grid, record, quick=True)
    for m in ("fedavg", "ifca", "stocfl"):
        assert f"| {m} | *pending* |" in shown  # the feature-shift family's table has the one scenario
        assert f"| {m} / rotated-digits / 0.5 |" not in shown
        assert f"| {m} / label-swap-digits / 0.5 |" in shown
    assert "Not shown: 6 recorded runs made under a config the grid no longer asks" in shown
    assert "(6 of them recorded under older figures or another config, to run again)" in shown
    capsys.readouterr()
    assert lab(["benchmark", "--grid", str(d / "grid.toml"), "--quick", "--quiet"]) == 0
    assert "6 runs run, 6 reused" in capsys.readouterr().out
    after = read_record(d / "BENCHMARK-quick.json")
    assert asked(grid, after, quick=True)["stale"] == [] and len(after["runs"]) == 12
    changed = [k for k in after["runs"] if after["runs"][k]["digest"] != record["runs"][k]["digest"]]
    assert sorted(changed) == view["stale"]


def test_a_method_told_the_true_groups_runs_at_its_own_default_where_none_are_planted(tmp_path):
    """{k} is the scenario's true number of groups; a scenario without planted groups (k = 1)
    tells none, and the method keeps its own default (told 1, it would be FedAvg). Its other
    overrides still apply."""
    from stocfl.algorithms import ALGORITHMS

    text = GRID.read_text().replace(
        'set = ["algorithm.n_components={k}"]', 'set = ["algorithm.n_components={k}", "train.lr=0.07"]'
    )
    (tmp_path / "grid.toml").write_text(text)
    grid = load_grid(tmp_path / "grid.toml")
    cells = {(c.method.name, c.scenario.name): c for c in grid.cells() if c.participation == 0.1}
    told = {"ifca": "n_models", "fesem": "n_centers", "fedem": "n_components", "fedrc": "n_clusters"}
    told |= {"fedsoft": "n_clusters", "cflgp": "n_models"}
    for name, key in told.items():
        default = ALGORITHMS[name].Params().model_dump()[key]
        for scenario in grid.scenarios:
            if scenario.quick_only:
                continue
            algorithm = dict(grid.config(cells[(name, scenario.name)], 0).algorithm)
            held = ALGORITHMS[name].Params(**{k: v for k, v in algorithm.items() if k != "name"}).model_dump()[key]
            assert held == (scenario.k if scenario.k > 1 else default) and held > 1, (name, scenario.name, held)
    assert grid.config(cells[("fedem", "dirichlet-0.1")], 0).train.lr == 0.07


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
        (
            lambda t: t.replace('name = "cfl"', 'name = "cfl"\ntune = [["train.lr=0.1"]]'),
            "method 'cfl' declares 1 tuning settings, the budget is 5",
        ),
        (
            lambda t: t.replace('knob = [["algorithm.threshold=5"], ["algorithm.threshold=10"], ', "knob = ["),
            "method 'pacfl' declares 2 knob settings; the budget is its default and 4 others",
        ),
        (lambda t: t.replace('knob = [["algorithm.threshold=5"]', "knob = [5"), "pacfl: knob: expected a list"),
        (lambda t: t.replace('tune_on = "rotated"', 'tune_on = "nowhere"'), "tune_on = 'nowhere' is not a scenario"),
        (lambda t: t.replace("validation = 0.1\n", ""), "KeyError 'validation'"),
        (
            lambda t: t.replace('set = ["algorithm.n_centers={k}"]', 'set = ["algorithm.n_centres={k}"]'),
            "method 'fesem': config: unknown key 'algorithm.n_centres'",
        ),
        (
            lambda t: t.replace('"scenario.alpha=0.1"', '"scenario.alpha=-1"', 1),
            "scenario 'dirichlet-0.1': config: scenario.alpha",
        ),
        (
            lambda t: t.replace('["algorithm.threshold=5"]', '["algorithm.treshold=5"]'),
            "method 'pacfl': knob ['algorithm.treshold=5']: config: unknown key 'algorithm.treshold'",
        ),
        (
            lambda t: t.replace('["algorithm.tau=0.7"]', '["algorithm.tau=7"]'),
            "method 'stocfl': knob ['algorithm.tau=7']: config: algorithm.tau: tau must be in [-1, 1]",
        ),
        (
            lambda t: t.replace('["train.lr=0.8"]]', '["train.lr=-1"]]', 1),
            "method 'fedavg': tune ['train.lr=-1']: config: train.lr: must be > 0.0",
        ),
    ],
)
def test_a_bad_grid_is_one_line(tmp_path, capsys, edit, says):
    (tmp_path / "grid.toml").write_text(edit(GRID.read_text()))
    assert lab(["benchmark", "--grid", str(tmp_path / "grid.toml"), "--page"]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "\n" not in err, err
    assert lab(["benchmark", "--grid", str(GRID), "--page", "--shard", "3/2"]) in (0, 2)


@pytest.mark.parametrize(
    "corrupt, says",
    [
        (lambda e: "a run", "is not a table of fields"),
        (lambda e: [e.pop("digest"), None][1], "has no 'digest'"),
        (lambda e: e.update(digest="abc"), 'has digest = "abc", where it must be a config digest'),
        (lambda e: e.update(participation="0.1"), 'has participation = "0.1", where it must be a number in (0, 1]'),
        (lambda e: e.update(participation=2.0), "has participation = 2.0"),
        (lambda e: e.update(seed=True), "has seed = true, where it must be an integer"),
        (lambda e: [e["figures"].pop("accuracy"), None][1], "has figures = {"),
        (lambda e: e["figures"].update(accuracy="high"), "each a number or null"),
        (lambda e: e["figures"].update(ari=float("nan")), "each a number or null"),
        (lambda e: e.update(curve=[[5, 0.5], [10]]), "a list of [round, accuracy] pairs"),
        (lambda e: e.update(wall_seconds=-1), "has wall_seconds = -1, where it must be a number of seconds"),
        (lambda e: e.update(setting="train.lr=0.1"), "where it must be a list of overrides"),
        (lambda e: e.update(knob=0), "has knob = 0, where it must be an integer from 1"),
    ],
)
def test_a_record_with_a_malformed_run_is_one_line_naming_it(tmp_path, capsys, corrupt, says):
    """A benchmark record edited or damaged by hand: the page, a run or a merge refuses it in
    one line naming the run and the field, exit code 2, never a traceback."""
    record = json.loads((REPO / "benchmark" / "BENCHMARK.json").read_text())
    key = sorted(record["runs"])[7]
    replaced = corrupt(record["runs"][key])  # None: changed in place
    if replaced is not None:
        record["runs"][key] = replaced
    (tmp_path / "bad.json").write_text(json.dumps(record))
    for args in (["--page"], ["--merge", str(tmp_path / "bad.json")]):
        target = tmp_path / ("bad.json" if args == ["--page"] else "empty.json")
        capsys.readouterr()
        assert lab(["benchmark", "--grid", str(GRID), "--record", str(target), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"run {key!r} " in err and says in err, err
        assert "Traceback" not in err


def test_the_committed_leaderboard_is_what_the_record_gives():
    """docs/benchmark.md is written from benchmark/BENCHMARK.json by one command
    (stocfl-lab benchmark --page --out docs/benchmark.md): it never drifts from the record."""
    from stocfl_lab.benchmark import page, read_record

    assert (REPO / "docs" / "benchmark.md").read_text() == page(
        load_grid(GRID), read_record(REPO / "benchmark" / "BENCHMARK.json")
    ), "run: stocfl-lab benchmark --page --out docs/benchmark.md"


def test_a_run_of_older_figures_runs_again_and_must_give_the_same_numbers(quick, tmp_path, capsys):
    """A recorded run without the newer figures (an older version) is run again, not reused; the
    same config giving the same numbers, it is not flagged; a recorded number that the run does
    not give again is said, even with --quiet."""
    d = tmp_path / "again"
    d.mkdir()
    shutil.copy(GRID, d / "grid.toml")
    record = json.loads((quick / "BENCHMARK-quick.json").read_text())
    keys = sorted(record["runs"])
    old = record["runs"][keys[0]]
    old.pop("figures_version")
    del old["figures"]["flops_per_round"]
    tampered = record["runs"][keys[1]]
    tampered.pop("figures_version")
    tampered["figures"]["accuracy"] = 0.123
    here = (tampered["processor"], tampered["threads"])
    tampered["processor"] = "Another CPU, AVX2"  # recorded elsewhere: the warning says so
    drawn = record["runs"][keys[2]]  # its final figures kept, one point of its curve moved
    drawn.pop("figures_version")
    t, acc = drawn["curve"][0]
    drawn["curve"][0] = [t, acc + 0.5]
    (d / "BENCHMARK-quick.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert lab(["benchmark", "--grid", str(d / "grid.toml"), "--quick", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "3 runs run (3 of them run again for newer figures, 2 with other numbers), 9 reused" in out, out
    said = f"{keys[2]}: WARNING run again under the same config, its accuracy curve changed at 1 of "
    assert said in out and f"({t}: {acc + 0.5} -> {acc})" in out, out
    assert f"{keys[1]}: WARNING run again under the same config, its figures changed: accuracy 0.123 -> " in out
    assert "macro_accuracy" not in out.split(keys[1])[1].split("\n")[0], "only the figures that changed"
    line = {k: next(x for x in out.splitlines() if x.startswith(k + ":")) for k in keys[1:3]}
    assert (
        f"recorded on Another CPU, AVX2 at {here[1]} torch threads, run again on {here[0]} at {here[1]}"
        in line[keys[1]]
    )
    assert f"on the same processor ({here[0]}) and torch threads ({here[1]}): not the machine" in line[keys[2]]
    assert keys[0] + ":" not in out
    again = json.loads((d / "BENCHMARK-quick.json").read_text())["runs"]
    first = json.loads((quick / "BENCHMARK-quick.json").read_text())["runs"][keys[0]]["figures"]
    assert again[keys[0]]["figures"] == first | {"seconds": again[keys[0]]["figures"]["seconds"]}


@pytest.mark.long
def test_tuning_chooses_on_the_validation_split_and_runs_the_tuned_rows(quick, capsys):
    """--tune: each method's budget of settings once at the protocol's seed and participation,
    with scenario.validation (the clients' test data unused); the choice is the best validation
    accuracy; --tuned runs each cell's chosen setting at every seed, and none where the default
    was chosen; the page gives the tuned rows and the tuning table."""
    from stocfl_lab.benchmark import tuning_choice

    base = ["benchmark", "--grid", str(quick / "grid.toml"), "--quick", "--quiet"]
    assert lab([*base, "--tune"]) == 0
    grid = load_grid(quick / "grid.toml")
    record = json.loads((quick / "BENCHMARK-quick.json").read_text())
    tune = {k: e for k, e in record["runs"].items() if k.startswith("tune / ")}
    # methods x scenarios x settings, and StoCFL's knob (tau) at one setting besides its default
    # on each scenario; IFCA's (its number of models) is not tuned where the scenario tells it
    assert len(tune) == 3 * 2 * 2 + 2
    for key, e in tune.items():
        name = f"knob{e['knob']}" if "knob" in e else f"setting{e['tune']}"
        text = next((quick / "runs" / "tune" / e["scenario"] / e["method"]).glob(f"{name}-*/config.toml")).read_text()
        assert "validation = 0.2" in text and "sample_rate = 0.5" in text and "seed = 0" in text
        assert e["default_setting"] == (e["setting"] == ["train.lr=0.1"]), key
    expected = 0
    for m in ("fedavg", "ifca", "stocfl"):
        for s in grid.scenarios:
            if not s.quick_only:
                continue
            (i, j), chosen = tuning_choice(grid, record, m, s, True)
            accs = [tune[f"tune / {m} / {s.name} / {k}"]["figures"]["accuracy"] for k in (0, 1)]
            assert accs[i] == max(accs) and (accs[0] < accs[1] or i == 0)
            if m == "stocfl":  # the knob at the step chosen: tau = 0.3 where it beats the default
                knob = tune[f"tune / stocfl / {s.name} / knob 1"]
                lr = ["train.lr=0.1", "train.lr=0.3"][i]
                assert knob["setting"] == [lr, "algorithm.tau=0.3"] and knob["tune"] == i
                assert j == (1 if knob["figures"]["accuracy"] > accs[i] else 0)
                assert chosen["setting"] == ([lr, "algorithm.tau=0.3"] if j else [lr])
            else:
                assert j == 0
            expected += 0 if chosen["default_setting"] else 2  # two seeds at one participation
    capsys.readouterr()
    stale = quick / "figures" / "benchmark-quick" / "gone-p0.5.png"  # a cell the record no longer has
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(b"\x89PNG")
    assert lab([*base, "--tuned", "--out", str(quick / "tuned.md")]) == 0
    assert not stale.exists(), "the page's figures are the record's: a figure of no cell goes"
    assert f"{expected} runs run" in capsys.readouterr().out
    record = json.loads((quick / "BENCHMARK-quick.json").read_text())
    tuned = [e for e in record["runs"].values() if e.get("tuned_of")]
    assert len(tuned) == expected
    scenarios = {s.name: s for s in grid.scenarios}
    for e in tuned:  # each at the setting tuning chose: the step and, where it won, the knob
        assert e["setting"] == tuning_choice(grid, record, e["tuned_of"], scenarios[e["scenario"]], True)[1]["setting"]
    text = (quick / "tuned.md").read_text()
    assert "| stocfl, tuned |" in text and "## Tuning" in text and "tuning pending" not in text


def test_a_record_without_its_processor_says_the_machine_may_explain_other_numbers():
    from stocfl_lab.rerun import where_run as _where_run

    now = {"processor": "Intel(R) Xeon(R) Processor, AVX512", "threads": 1}
    assert "recorded without its processor (run again on Intel(R) Xeon(R) Processor, AVX512, 1 torch" in _where_run(
        {}, now
    )
    assert "run again on Intel(R) Xeon(R) Processor, AVX512 at 1" in _where_run(now | {"threads": 2}, now)


def test_the_tuning_choice_is_the_best_validation_accuracy_first_of_equals_none_worst():
    from stocfl_lab.benchmark import tuning_choice

    grid = load_grid(GRID)
    rotated = next(s for s in grid.scenarios if s.name == "rotated")
    drift = next(s for s in grid.scenarios if s.name == "rotated-drift")

    def record(accs):
        runs = {
            f"tune / ifca / rotated / {i}": {"figures": {"accuracy": a}, "setting": [f"s{i}"], "quick": False}
            for i, a in enumerate(accs)
        }
        return {"runs": runs}

    assert tuning_choice(grid, record([None, 0.5, 0.7, 0.7, 0.6]), "ifca", rotated, False)[0] == (2, 0)
    assert tuning_choice(grid, record([None, None, None, None, None]), "ifca", rotated, False)[0] == (0, 0)
    assert tuning_choice(grid, record([0.1, 0.9, 0.2, 0.3, 0.4]), "ifca", drift, False)[0] == (1, 0)  # rotated's
    assert tuning_choice(grid, record([0.1, 0.9, 0.2, 0.3]), "ifca", rotated, False) is None  # a setting missing


def test_the_knob_is_chosen_at_the_step_chosen_its_default_first_of_equals():
    """Where a method's knob is tuned (IFCA's number of models: where no groups are planted),
    the choice waits for the knob's runs at the step chosen, takes the best of the step's own run
    (the knob's default) and the knob's, the default first of equals, and ignores a knob run made
    at another step."""
    from stocfl_lab.benchmark import knob_key, tuning_choice

    grid = load_grid(GRID)
    dirichlet = next(s for s in grid.scenarios if s.name == "dirichlet-0.1")
    steps, knob = grid.tune_settings("ifca"), grid.knob_settings("ifca")
    assert grid.knob_on("ifca", dirichlet) and len(knob) == len(steps) - 1

    def record(step_accs, knob_accs, at=1):
        runs = {
            f"tune / ifca / dirichlet-0.1 / {i}": {"figures": {"accuracy": a}, "setting": list(steps[i])}
            for i, a in enumerate(step_accs)
        }
        for j, a in enumerate(knob_accs, start=1):
            runs[knob_key("ifca", "dirichlet-0.1", j)] = {
                "figures": {"accuracy": a},
                "setting": [*steps[at], *knob[j - 1]],
            }
        return {"runs": runs}

    step = [0.1, 0.6, 0.2, 0.3, 0.4]  # the step chosen: setting 1 (0.6)
    assert tuning_choice(grid, record(step, [0.5, 0.7, 0.7]), "ifca", dirichlet, False) is None  # one missing
    (i, j), e = tuning_choice(grid, record(step, [0.5, 0.7, 0.7, None]), "ifca", dirichlet, False)
    assert (i, j) == (1, 2) and e["setting"] == [*steps[1], *knob[1]]
    assert tuning_choice(grid, record(step, [0.6, 0.6, 0.5, 0.1]), "ifca", dirichlet, False)[0] == (1, 0)
    assert tuning_choice(grid, record(step, [0.9, 0.9, 0.9, 0.9], at=2), "ifca", dirichlet, False) is None
    rotated = next(s for s in grid.scenarios if s.name == "rotated")  # IFCA is told rotated's 4 groups
    assert not grid.knob_on("ifca", rotated) and grid.knob_on("stocfl", rotated) and not grid.knob_on("fedavg", rotated)


def test_the_rest_of_the_grid_is_costed_from_the_runs_recorded():
    """Each run still needed is costed from its cell's runs, else the same method and scenario
    at the other participation times the measured ratio, else its scenario's other methods
    times the method's own ratio; a run of older figures counts as needed again; tuning that
    chose the default needs no tuned row."""
    from stocfl_lab.benchmark import FIGURES_VERSION, Grid, Method, Scenario, _projection_text, projected_cost

    s, t = (Scenario(n, "f", 2, 0.5, ()) for n in ("s", "t"))
    tune = {"seed": 0, "participation": 0.1, "validation": 0.1, "settings": [["train.lr=0.1"], ["train.lr=0.2"]]}
    grid = Grid("g", (0, 1), (0.1, 1.0), (), (Method("a"), Method("b")), (s, t), {}, tune)

    def run(m, sc, p, seed, wall, version=FIGURES_VERSION, **more):
        key = f"{m} / {sc} / {p:g} / seed {seed}"
        entry = {"method": m, "scenario": sc, "participation": p, "wall_seconds": wall, "figures_version": version}
        return key, entry | {"figures": {"accuracy": 0.5}} | more

    runs = dict(
        [
            run("a", "s", 0.1, 0, 10.0),
            run("a", "s", 0.1, 1, 20.0),  # a / s / 0.1: 15 s a run
            run("a", "s", 1.0, 0, 60.0),  # 4x at participation 1
            run("b", "s", 0.1, 0, 30.0),
            run("a", "t", 0.1, 0, 5.0),
            run("a", "t", 0.1, 1, 5.0, version=FIGURES_VERSION - 1),  # to run again
        ]
    )
    for i, (acc, default) in enumerate([(0.9, True), (0.5, False)]):  # a on s chose its default
        runs[f"tune / a / s / {i}"] = {
            "method": "a", "scenario": "s", "participation": 0.1, "tune": i, "wall_seconds": 1.0,
            "figures": {"accuracy": acc}, "setting": tune["settings"][i], "default_setting": default,
            "figures_version": FIGURES_VERSION,
        }  # fmt: skip
    pc = projected_cost(grid, {"runs": runs})
    b_t = 5.0 * (30.0 / 22.5)  # t's one method's time x b's ratio to the other methods on s
    default = 60 + 30 + 2 * 120 + 5 + 2 * 20 + 2 * b_t + 2 * 4 * b_t
    tuning = 2 * 30 + 2 * 5 + 2 * b_t  # b on s, a on t, b on t: two settings each, at participation 0.1
    tuned = 2 * 30 + 2 * 120 + 2 * 5 + 2 * 20 + 2 * b_t + 2 * 4 * b_t  # every cell but a on s
    assert pc["runs"] == {"default": 11, "tune": 6, "tuned": 12} and pc["rerun"] == 1
    assert math.isclose(pc["hours"] * 3600, default + tuning + tuned)
    assert pc["ratio"] == [(1.0, 0.1, 4.0, 1)]
    text = _projection_text(pc)
    assert "11 runs with the papers' defaults (1 of them recorded under older figures" in text
    assert "takes 4x one at 0.1" in text
    done = {"runs": {k: v | {"figures_version": FIGURES_VERSION} for k, v in runs.items()}}
    full = Grid("g", (0,), (0.1,), (), (Method("a"),), (s,), {}, tune)
    assert _projection_text(projected_cost(full, done)).startswith("The grid is complete")
    # a knob (one setting besides its default: the budget less one) adds its run per (method, scenario)
    knobbed = Grid(
        "g", (0, 1), (0.1, 1.0), (), (Method("a"), Method("b", knob=(("algorithm.x=1",),))), (s, t), {}, tune
    )
    more = projected_cost(knobbed, {"runs": runs})
    assert more["runs"] == {"default": 11, "tune": 8, "tuned": 12}
    assert math.isclose(more["hours"] * 3600, default + tuning + 30 + b_t + tuned)
