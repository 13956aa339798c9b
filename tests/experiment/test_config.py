import re
import subprocess
import sys

import pytest

from stocfl import config
from stocfl.cli import main
from stocfl.errors import UserError
from stocfl.experiment import configure


def test_defaults_validate_and_resolve():
    cfg = configure.load()
    d = cfg.to_dict()
    assert set(d) == {"run", "scenario", "model", "train", "aggregation", "algorithm"}
    assert d["algorithm"] == {"name": "fedavg", "chain": False}
    assert configure.load(overrides=["algorithm.name=fedprox"]).to_dict()["algorithm"] == {
        "name": "fedprox",
        "chain": False,
        "mu": 0.01,
    }


def test_an_algorithm_parameter_set_before_the_name_is_kept_and_the_files_are_dropped(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[algorithm]\nname = "ifca"\nn_models = 4\n')
    for order in (["algorithm.tau=-0.9", "algorithm.name=stocfl"], ["algorithm.name=stocfl", "algorithm.tau=-0.9"]):
        algo = configure.load(f, order).to_dict()["algorithm"]
        assert algo["name"] == "stocfl" and algo["tau"] == -0.9 and "n_models" not in algo


def test_overrides_are_typed():
    cfg = configure.load(overrides=["run.rounds=5", "train.lr=0.5", "scenario.name=shifted"])
    assert (cfg.run.rounds, cfg.train.lr, cfg.scenario.name) == (5, 0.5, "shifted")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["run.roundz=5"], "unknown key 'run.roundz'"),
        (["bogus.x=1"], "unknown key 'bogus'"),
        (["run.rounds='five'"], "run.rounds"),
        (["run.rounds=2.5"], "run.rounds"),
        (["run.sample_rate=-0.1"], "run.sample_rate"),
        (["scenario.name=spiral"], "scenario.name"),
        (["algorithm.name=nope"], "unknown algorithm 'nope'"),
        (["algorithm.name=fedprox", "algorithm.mu=-1"], "algorithm.mu"),
        (["algorithm.name=fedavg", "algorithm.mu=0.1"], "unknown key 'algorithm.mu' for fedavg"),
        (["run.rounds"], "expected dotted.key=value"),
        # a key of two types: pydantic's one error per type read "algorithm.tau.float: expected a number"
        (["algorithm.name=stocfl", "algorithm.tau='0.5'"], "algorithm.tau: expected a number or \"auto\" (got '0.5')"),
        (["run.eval_rounds=[5, 3]"], "run.eval_rounds: expected increasing rounds, each once (got [5, 3])"),
        (["run.rounds=4", "run.eval_rounds=[2, 5]"], "run.eval_rounds: every round must be in 1..run.rounds = 4"),
        (["run.eval_rounds=[0]"], "run.eval_rounds: every round must be in 1..run.rounds"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(overrides, expected):
    with pytest.raises(UserError) as err:
        configure.load(overrides=overrides)
    msg = str(err.value)
    assert expected in msg and "\n" not in msg


def test_toml_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nrounds = \n")
    with pytest.raises(UserError, match="not valid TOML"):
        configure.load(bad)
    with pytest.raises(UserError, match="not found"):
        configure.load(tmp_path / "missing.toml")
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(UserError, match="dir.toml is a directory"):
        configure.load(tmp_path / "dir.toml")
    bom = tmp_path / "bom.toml"  # as some Windows editors save it
    bom.write_bytes(b"\xef\xbb\xbf[run]\nrounds = 7\n")
    assert configure.load(bom).run.rounds == 7


def test_cli_bad_input_exits_2_with_one_line(tmp_path, capsys):
    for argv in (
        ["run", "--set", "run.sample_rate=-1", "--out", str(tmp_path / "a")],
        ["run", "--set", 'run.rounds="5"', "--out", str(tmp_path / "b")],
        ["run", "--set", "scenario.dataset=mnist", "--data-dir", str(tmp_path), "--out", str(tmp_path / "c")],
        ["resume", str(tmp_path / "nothing")],
        ["run", "--no-such-flag"],
    ):
        with pytest.raises(SystemExit) if "--no-such-flag" in argv else _nothing():
            code = main(argv)
            assert code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stocfl: error:") and "\n" not in err, err
    assert not (tmp_path / "c").exists(), "a data error must not leave a half-made results directory"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.long
def test_cli_subprocess_no_traceback(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[run]\nrounds = 3\nunknown = 1\n")
    p = subprocess.run([sys.executable, "-m", "stocfl", "run", str(cfg)], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "stocfl: error: config: unknown key 'run.unknown'; allowed keys here: rounds, sample_rate, seed, "
        "eval_every, eval_rounds, target_accuracy, engine, threads, device, client_timeout, chunk_size, "
        "factored_replies, store_ram, tensorboard, "
        "sim_nodes, node_wait"
    )


def test_config_listing_documents_every_key(capsys):
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    for section, model in config.Config.model_fields.items():
        if section != "algorithm":
            for key in model.annotation.model_fields:
                assert re.search(rf"^  {key} +=", out, re.M), key
    assert re.search(r"^  mu += 0.01 ", out, re.M)
    assert re.search(r"^  tensorboard += false ", out, re.M) and re.search(r'^  engine += "auto" ', out, re.M)  # TOML


def test_run_dependent_errors_are_one_line_exit_2(tmp_path, capsys):
    """Errors that only show once the run's data and sampling are known: one line, exit
    code 2, and no results directory left behind."""
    for argv in (
        [
            "run",
            "--set",
            "algorithm.name=fesem",
            "--set",
            "algorithm.n_centers=9",
            "--set",
            "scenario.n_clients=20",
            "--out",
            str(tmp_path / "fesem"),
        ],  # round 1 samples 2 clients, K = 9
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("stocfl: error:") and "\n" not in err and "n_centers" in err, err
        assert not (tmp_path / "fesem").exists()


def test_a_model_that_does_not_fit_the_data_is_one_line():
    from stocfl.client.models import FlatModel, cnn28, mlp
    from stocfl.data.datasets import load_dataset
    from stocfl.data.scenarios import build
    from stocfl.experiment.build import check_model_fits

    fed = build("iid", load_dataset("digits"), 2, 10, seed=0)
    for module, what in (
        (cnn28(1, 10), "does not fit digits inputs of shape (1, 8, 8)"),
        (mlp(64, 8, 7), "outputs of shape (7,)"),
    ):
        w0 = FlatModel.init_weights(module, 0)
        with pytest.raises(UserError, match=what.replace("(", r"\(").replace(")", r"\)")) as err:
            check_model_fits(FlatModel(module), w0, fed, "mine")
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "bad, says",
    [
        ("run.rounds=x", "run.rounds: expected an integer (got 'x')"),
        ("run.sample_rate=true", "run.sample_rate: expected a number (got True)"),
        ("scenario.alpha=-1", "scenario.alpha: must be >= 0.001 (got -1)"),
        ("run.rounds=0", "run.rounds: must be >= 1 (got 0)"),
        ("train.optimizer=foo", "train.optimizer: expected one of sgd or adam (got 'foo')"),
        ("train.local_bn=3", "train.local_bn: expected true or false (got 3)"),
    ],
)
def test_config_errors_speak_one_house_style(bad, says):
    with pytest.raises(UserError) as err:
        configure.load(None, [bad])
    text = str(err.value)
    assert text == f"config: {says}", text
    assert "Input should" not in text and "Value error" not in text


def test_a_bad_command_line_names_the_program_once(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--bogus"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "stocfl stocfl" not in err and err.startswith("stocfl: error:") and "(see stocfl --help)" in err


def test_stocfl_config_aligns_its_columns_and_lists_the_choices(capsys):
    assert main(["config"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len({line.index(" = ") for line in lines}) == 1 and len({line.index("  # ") for line in lines}) == 1
    text = "\n".join(lines)
    assert (
        "one of: gradient, update" in text
        and "one of: init, linear" in text
        and "label_swap, permuted_labels, hybrid" in text
    )


def test_the_schema_knows_no_registry_and_settle_checks_names_and_params_once():
    from stocfl import config as schema

    raw = schema.validate({"algorithm": {"name": "stocfl", "tau": 0.5}, "run": {"engine": "no-such-engine"}})
    assert not raw.settled  # the schema alone: sections checked, names and parameters not
    with pytest.raises(UserError, match=r"^config: .*not checked yet"):
        raw.to_dict()
    with pytest.raises(UserError, match=r"^config: run.engine: unknown engine 'no-such-engine'; choose one of"):
        configure.settle(raw)
    for bad, says in (
        ({"scenario": {"name": "nope"}}, r"^config: scenario.name: unknown scenario 'nope'"),
        ({"scenario": {"dataset": "nope"}}, r"^config: scenario.dataset: unknown data set 'nope'"),
        ({"model": {"name": "nope"}}, r"^config: model.name: unknown model 'nope'"),
        ({"algorithm": {"name": "nope"}}, r"^config: algorithm.name: unknown algorithm 'nope'"),
        ({"algorithm": {"name": "ifca", "tau": 1}}, r"^config: unknown key 'algorithm.tau' for ifca; allowed keys"),
    ):
        with pytest.raises(UserError, match=says):
            configure.validate(bad)
    cfg = configure.validate({"algorithm": {"name": "stocfl", "tau": 0.5}})
    assert cfg.params.tau == 0.5 and cfg.to_dict()["algorithm"]["tau"] == 0.5
    cfg.algorithm["tau"] = 0.25  # changed after settling: never a digest of the old parameters
    with pytest.raises(UserError, match="changed since"):
        cfg.to_dict()
    assert configure.settle(cfg).params.tau == 0.25
