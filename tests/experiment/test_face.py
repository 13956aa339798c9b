"""stocfl as a user meets it: configs by name, the packaged default, compare from Python, short
reprs, the caller's torch threads kept, saved runs read, one line for what moved or cannot be
resumed from the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import stocfl
from stocfl import config
from stocfl.cli import main
from stocfl.errors import UserError
from stocfl.experiment import configure
from tests.experiment.test_api import rotated_clients

FAST = {"run": {"rounds": 3, "sample_rate": 0.5}, "train": {"epochs": 1}}


def _fed():
    train, test, groups = rotated_clients(n_per_group=3, per_client=20, test=10)
    return stocfl.Federation.from_arrays(train=train, test=test, groups=groups)


def test_packaged_configs_run_by_name_and_list_themselves(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here: the names resolve to the package's files
    names = config.packaged()
    assert {"default", "rotated_mnist_4800x50", "rotated_cifar10", "femnist_writers"} <= set(names)
    for name, path in names.items():  # every packaged config is valid and loads by name as by path
        assert (
            configure.load(name).to_dict()
            == configure.load(path).to_dict()
            == configure.load(f"configs/{name}.toml").to_dict()
        )
    assert main(["config", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == list(names)
    assert main(["run", "nope_not_a_config", "--quiet"]) == 2
    assert "name of a packaged config (stocfl config --list)" in capsys.readouterr().err


def test_run_without_a_config_is_the_packaged_default(tmp_path):
    out = tmp_path / "r"
    assert main(["run", "--quiet", "--out", str(out), "--set", "run.rounds=2"]) == 0
    resolved = configure.load(out / "config.toml")
    assert resolved.to_dict() == configure.load("default", ["run.rounds=2"]).to_dict()
    assert resolved.algorithm["name"] == "stocfl"


def test_compare_from_python_is_the_mean_over_its_runs_and_refuses_bad_specs_first(tmp_path):
    fed = _fed()
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    cmp = stocfl.compare(
        ["fedavg", "ifca n_models=2"],
        FAST,
        seeds=[0, 1],
        federation=fed,
        model=module,
        progress=False,
        out=tmp_path / "c",
    )
    assert list(cmp.results) == ["fedavg", "ifca-n_models=2"] and all(len(v) == 2 for v in cmp.results.values())
    for row in cmp.rows:
        accs = [r.summary["accuracy"] for r in cmp.results[row["algorithm"]]]
        assert row["accuracy_mean"] == pytest.approx(np.mean(accs), abs=0) and row["seeds"] == 2
    assert [r.summary["seed"] for r in cmp.results["fedavg"]] == [0, 1]
    alone = stocfl.run(
        {**FAST, "algorithm": {"name": "ifca", "n_models": 2}, "run": {**FAST["run"], "seed": 1}},
        federation=fed,
        model=module,
        progress=False,
    )

    def untimed(rows):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]

    assert untimed(alone.metrics) == untimed(cmp.results["ifca-n_models=2"][1].metrics)  # each run is the run it names
    assert "| fedavg | 2 |" in str(cmp) and (tmp_path / "c" / "compare.md").read_text() == cmp.markdown()
    assert (tmp_path / "c" / "compare.png").stat().st_size > 1000 and (tmp_path / "c" / "fedavg-seed1").is_dir()
    for bad, match in (
        (["fedavg", "fedavg"], "given twice"),
        (["nope"], "unknown algorithm"),
        (["ifca n_models=0"], "n_models"),
        ("fedavg", "a list of specs"),
    ):
        with pytest.raises(UserError, match=match):
            stocfl.compare(bad, FAST, federation=fed, model=module, progress=False)
    with pytest.raises(UserError, match="seed 0 is given twice"):
        stocfl.compare(["fedavg"], FAST, seeds=[0, 0], federation=fed, model=module, progress=False)


def test_reprs_are_short_and_a_run_puts_the_callers_threads_back():
    fed = _fed()
    assert repr(fed).startswith("Federation(") and "tensor(" not in repr(fed) and len(repr(fed)) < 200
    assert "6 clients" in repr(fed) and "2 true groups" in repr(fed)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = stocfl.run({**FAST, "run": {**FAST["run"], "threads": 0}}, federation=fed, progress=False)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    text = repr(result)
    assert text.startswith("Result(fedavg on") and "accuracy" in text and len(text) < 300


def test_a_saved_run_opens_with_its_digest_and_whether_it_finished(tmp_path):
    out = tmp_path / "r"
    stocfl.run_into(out, {**FAST, "scenario": {"n_clients": 8}}, progress=False)
    saved = stocfl.open_run(out)
    assert saved.digest == stocfl.config_digest(configure.load(out / "config.toml"))
    assert saved.finished == json.loads((out / "summary.json").read_text())
    loaded = saved.load()
    w = loaded.global_model()
    x, y = loaded.federation.test_data(0)
    assert 0.0 <= loaded.accuracy(w, x, y) <= 1.0 and loaded.federation.n_clients == 8
    with pytest.raises(UserError, match="holds no run|unreadable"):
        stocfl.open_run(tmp_path / "nothing")


def test_moved_commands_and_python_registered_names_get_one_line(tmp_path, capsys):
    assert main(["reproduce", "--list"]) == 2
    assert capsys.readouterr().err.strip() == (
        "stocfl: error: 'stocfl reproduce' moved to the lab: run 'stocfl-lab reproduce --list' (installed by "
        "'make setup', or 'pip install ./lab' in a clone)"
    )
    assert main(["bench", "--quick"]) == 2 and "'stocfl-lab bench --quick'" in capsys.readouterr().err

    @stocfl.register_algorithm
    class OnlyHere(stocfl.algorithms.FedAvg):
        name = "only_here_face_test"

    out = tmp_path / "mine"
    stocfl.run({**FAST, "algorithm": {"name": "only_here_face_test"}}, out=out, progress=False)
    stocfl.algorithms.ALGORITHMS.pop("only_here_face_test")  # as in a new process
    assert main(["resume", str(out), "--set", "run.rounds=4", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "algorithm.name = 'only_here_face_test'" in err[0] and "stocfl.resume(" in err[0]


def test_engine_choices_come_from_the_registry(tmp_path):
    from stocfl.executors import SequentialExecutor

    stocfl.register_engine(
        stocfl.Engine(
            "face-test-engine",
            "the sequential loop under another name",
            executor=lambda fed, model, cfg: SequentialExecutor(fed, model),
        )
    )
    try:
        out = tmp_path / "e"
        assert main(["run", "--quiet", "--out", str(out), "--engine", "face-test-engine", "--set", "run.rounds=1"]) == 0
        assert configure.load(out / "config.toml").run.engine == "face-test-engine"
    finally:
        from stocfl.executors import ENGINES

        ENGINES.pop("face-test-engine")


def test_the_lab_says_where_its_tables_are(tmp_path, capsys):
    from stocfl_lab.cli import main as lab_main

    assert lab_main(["reproduce", "--list", "--tables", str(tmp_path)]) == 2
    assert "pass --tables DIR" in capsys.readouterr().err


def test_the_version_is_written_once_and_printed_by_the_command(capsys):
    """``stocfl --version`` prints the package's one version, the one the metadata reads."""
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"stocfl {stocfl.__version__}"
    assert version("stocfl") == stocfl.__version__


def test_a_run_directory_may_be_given_as_a_string(tmp_path):
    """Experiment.create / open / resume take a str as well as a Path (it was a TypeError)."""
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    cfg = configure.load(overrides=["run.rounds=2", "scenario.n_clients=8"])
    out = str(tmp_path / "s")
    assert Experiment.create(cfg, out).run(progress=False, stop_after=1) is None
    assert Experiment.open(out).round == 1
    assert Experiment.resume(out).run(progress=False)["rounds_done"] == 2
