"""Config fuzz: generated configs, each a small valid run with one key (or a few) set to a
hostile value, run in process up to the end of round 1. Every case either runs or is refused
with one line naming the key it set (exit code 2 on the command line); never a traceback,
never a hang (an alarm stops a case after CASE_SECONDS)."""

from __future__ import annotations

import math
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stocfl import config
from stocfl.algorithms import ALGORITHMS
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

CASE_SECONDS = 20
BASE = {
    "run": {"rounds": 1, "sample_rate": 0.5, "engine": "sequential", "threads": 1},
    "scenario": {"name": "rotated", "n_clients": 8, "samples_per_client": 10},
    "train": {"epochs": 1, "batch_size": 5, "lr": 0.1},
}
SMALL = {"n_models": 2, "n_centers": 2, "warmup_rounds": 0, "restarts": 2, "psi_epochs": 1}

HOSTILE = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 10**6, 10**12, 10**20, 2**63, -(2**63), 10**400]),
    st.sampled_from(
        [0.0, -0.0, 1e-300, -1e-9, 0.5, 0.999999, 1.0, 1.5, 1e6, 1e38, 1e308, math.inf, -math.inf, math.nan]
    ),
    st.sampled_from(["", "auto", "x", "0", "1e3", "nan", "\x00", "../../etc", "fedavg", "stocfl", "ü" * 40]),
    st.booleans(),
    st.lists(st.integers(-2, 2), max_size=3),
    st.dictionaries(st.sampled_from(["a", "name", "x"]), st.integers(0, 3), max_size=2),
    st.recursive(st.integers(0, 3), lambda inner: st.dictionaries(st.just("n"), inner, min_size=1), max_leaves=6),
)


def keys_of(algorithm: str) -> list[tuple[str, str]]:
    out = [(s, k) for s, f in config.Config.model_fields.items() if s != "algorithm" for k in f.annotation.model_fields]
    params = ALGORITHMS[algorithm].Params.model_fields
    return out + [("algorithm", f.alias or k) for k, f in params.items()] + [("algorithm", "name")]


@st.composite
def cases(draw):
    algorithm = draw(st.sampled_from(sorted(ALGORITHMS)))
    raw = {s: dict(v) for s, v in BASE.items()}
    params = ALGORITHMS[algorithm].Params.model_fields
    raw["algorithm"] = {
        "name": algorithm,
        **{k: v for k, v in SMALL.items() if k in params or any(f.alias == k for f in params.values())},
    }
    keys = draw(st.lists(st.sampled_from(keys_of(algorithm)), min_size=1, max_size=2, unique=True))
    for section, key in keys:
        raw.setdefault(section, {})[key] = draw(HOSTILE)
    return raw, keys


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"no answer within {CASE_SECONDS} s")


@pytest.mark.long
@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_a_fuzzed_config_runs_or_is_refused_in_one_line_naming_its_key(tmp_path_factory, case):
    raw, keys = case
    out = tmp_path_factory.mktemp("fuzz") / "run"
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_SECONDS)
    try:
        cfg = configure.validate(raw)
        exp = Experiment.create(cfg, out)
        exp.run(progress=False, stop_after=1)
    except UserError as err:
        msg = str(err)
        assert "\n" not in msg and msg, msg
        named = [f"{s}.{k}" for s, k in keys]
        if ("algorithm", "name") in keys:  # another algorithm: its parameters may now be unknown keys
            named += [f"algorithm.{k}" for k in raw["algorithm"]]
        assert any(n in msg for n in named), f"{msg!r} names none of {named}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_the_command_line_gives_exit_2_and_one_line(tmp_path, capsys):
    from stocfl.cli import main

    assert main(["run", "--set", "model.hidden=1000000000000", "--out", str(tmp_path / "a"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.hidden" in err


@pytest.mark.parametrize(
    "argv, named",
    [
        (["run", "--out", "/dev/null/x", "--set", "run.rounds=1"], "/dev/null/x"),
        (["run", "--out", "a\x00b"], "--out"),
        (["run", "--data-dir", "a\x00b"], "--data-dir"),
        (["run", "--set", 'scenario.data_dir="a\\u0000b"'], "scenario.data_dir"),
        (["certs", "/dev/null/x"], "/dev/null/x"),
        (["certs", "{tmp}/c", "--host", ""], "--host"),
        (["certs", "{tmp}/c", "--host", "a b"], "--host"),
        (["certs", "{tmp}/c", "--days", "100000000"], "--days"),
        (["certs", "{tmp}/c", "--days", "0"], "--days"),
        (["resume", "/dev/null/x"], "/dev/null/x"),
        (["assign", "/dev/null/x"], "/dev/null/x"),
    ],
)
def test_bad_paths_and_arguments_give_one_line_and_exit_2(tmp_path, capsys, argv, named):
    from stocfl.cli import main

    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse refuses the argument itself
        code = stop.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and named in err, err
