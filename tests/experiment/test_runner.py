import json
import os
import signal
import subprocess
import sys
import time

import pytest

from stocfl.cli import main
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.build import build_federation
from stocfl.experiment.loop import Experiment, round_line
from stocfl.storage import formats

KEYS = {
    "algorithm",
    "scenario",
    "seed",
    "rounds_done",
    "accuracy",
    "global_accuracy",
    "n_clusters",
    "ari",
    "nmi",
    "label_cos_within",
    "label_cos_all",
    "seconds",
}
SMALL = ["run.rounds=6", "run.sample_rate=0.5", "scenario.n_clients=12", "scenario.samples_per_client=20"]


def _strip_times(obj):
    if isinstance(obj, dict):
        return {k: _strip_times(v) for k, v in obj.items() if k != "seconds"}
    return obj


def _metrics(out):
    return [_strip_times(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_run_writes_results(tmp_path, capsys):
    out = tmp_path / "r"
    assert (
        main(
            [
                "run",
                "--quiet",
                "--out",
                str(out),
                "--set",
                "run.eval_every=2",
                *[a for s in SMALL for a in ("--set", s)],
            ]
        )
        == 0
    )
    assert str(out.resolve()) in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert KEYS <= set(summary) and summary["rounds_done"] == 6
    rows = _metrics(out)
    assert [r["round"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["accuracy"] is None for r in rows] == [True, False, True, False, True, False]
    assert {"round", "accuracy", "global_accuracy", "n_clusters", "ari", "nmi", "label_cos_within"} <= set(rows[-1])
    assert 0 < rows[-1]["label_cos_all"] <= 1 and rows[-1]["label_cos_all"] == summary["label_cos_all"]
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "checkpoint.safetensors").exists()
    resolved = configure.load(out / "config.toml")
    # no config: the packaged default (StoCFL on rotated digits), every default filled in
    assert (
        resolved.run.rounds == 6 and resolved.to_dict()["algorithm"] == configure.load("default").to_dict()["algorithm"]
    )
    assert resolved.algorithm["name"] == "stocfl" and resolved.scenario.dataset == "digits"
    assert main(["run", "--quiet", "--out", str(out)]) == 2  # never overwrite a run


def test_same_seed_same_numbers(tmp_path):
    outs = []
    for k in range(2):
        cfg = configure.load(overrides=SMALL + ["algorithm.name=fedprox"])
        Experiment.create(cfg, tmp_path / str(k)).run(progress=False)
        outs.append(tmp_path / str(k))
    assert _metrics(outs[0]) == _metrics(outs[1])
    other = configure.load(overrides=SMALL + ["algorithm.name=fedprox", "run.seed=1"])
    Experiment.create(other, tmp_path / "s1").run(progress=False)
    assert _metrics(outs[0]) != _metrics(tmp_path / "s1")


@pytest.mark.long
@pytest.mark.parametrize(  # fedrc, fedsoft, pacfl: client stores; +schedule: clients join and leave; +drift
    "algorithm", ["stocfl", "fedrc", "fedsoft", "pacfl", "stocfl+schedule", "stocfl+drift"]
)
def test_resume_after_sigkill_is_identical(tmp_path, algorithm):
    """Kill a real run with SIGKILL part-way, resume it, compare with an uninterrupted run."""
    args = ["run.rounds=40", "run.sample_rate=0.5", "scenario.n_clients=40", "run.engine=sequential"]
    algorithm, _, living = algorithm.partition("+")
    args.append(f"algorithm.name={algorithm}")
    if living == "schedule":  # arrivals on either side of the kill
        args += ["scenario.present_at_start=0.5", "scenario.join_rounds=[3, 12, 30]"]
        args += ["scenario.leave=0.2", "scenario.leave_rounds=[20]"]
    if living == "drift":  # changes on either side of the kill
        args += ["scenario.drift=recurrent", "scenario.drift_rounds=[3, 12, 30]", "run.eval_every=2"]
    sets = [a for s in args for a in ("--set", s)]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    assert main(["run", "--quiet", "--out", str(ref), *sets]) == 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "stocfl", "run", "--quiet", "--out", str(cut), *sets],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while time.time() < deadline:
        m = cut / "metrics.jsonl"
        if m.exists() and len(m.read_text().splitlines()) >= 5:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len((cut / "metrics.jsonl").read_text().splitlines())
    assert 5 <= done < 40, "the kill must land mid-run"
    assert main(["resume", "--quiet", str(cut)]) == 0
    assert _metrics(ref) == _metrics(cut)
    a, b = (json.loads((d / "summary.json").read_text()) for d in (ref, cut))
    assert _strip_times(a) == _strip_times(b)
    assert main(["resume", "--quiet", str(cut)]) == 0  # resuming a finished run only rewrites its summary


@pytest.mark.long
def test_away_from_a_terminal_a_run_logs_one_line_per_round(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "stocfl",
            "run",
            "--out",
            str(tmp_path / "r"),
            "--set",
            "run.rounds=3",
            "--set",
            "run.eval_every=2",
            "--set",
            "scenario.n_clients=8",
            "--set",
            "algorithm.name=fedavg",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = [line for line in out.stderr.splitlines() if ": round " in line]
    assert [line.split(": round ")[1].split()[0] for line in lines] == ["1/3", "2/3", "3/3"], out.stderr
    assert "accuracy" not in lines[0] and "accuracy" in lines[1]
    assert all("placed 8 (100.0%)" in line for line in lines)  # what ARI is computed over, every round
    assert "\r" not in out.stderr  # no progress bar redrawn into a log file


def test_placing_new_clients_on_a_run_without_clusters_says_what_it_means(tmp_path):
    from stocfl.experiment.newclients import place_clients

    cfg = configure.load(overrides=["scenario.n_clients=12", "scenario.holdout=0.25", "run.rounds=2"])
    Experiment.create(cfg, tmp_path / "r").run(progress=False)
    rows, summary = place_clients(tmp_path / "r")
    assert len(rows) >= 3 and all(r["cluster"] == 0 and r["cosine"] is None and not r["would_open_new"] for r in rows)
    assert summary["placement"] == "one global model: a new client uses it (cluster 0)"


def test_placing_counts_each_held_out_client_once_and_only_those(tmp_path):
    # a client given twice counted twice in the accuracy; a client the run trained on was placed as new
    from stocfl.experiment.newclients import place_clients

    cfg = configure.load(overrides=["scenario.n_clients=8", "scenario.holdout=0.5", "run.rounds=1"])
    Experiment.create(cfg, tmp_path / "r").run(progress=False)
    rows, _ = place_clients(tmp_path / "r")
    held = [r["client"] for r in rows]
    assert len(held) == 4
    with pytest.raises(UserError, match=f"client {held[0]} is given twice; give each client once"):
        place_clients(tmp_path / "r", clients=[held[0], held[0]])
    trained = min(set(range(8)) - set(held))
    with pytest.raises(
        UserError,
        match=f"client {trained} took part in training, so it is not new; choose among "
        f"the held-out clients {','.join(map(str, held))}, or",
    ):
        place_clients(tmp_path / "r", clients=[trained])
    new, _ = place_clients(tmp_path / "r", ["run.seed=5"], clients=[trained])  # a new federation's client is new
    assert [r["client"] for r in new] == [trained]
    for same in (["run.seed=0"], ["scenario.test_per_client=3"]):  # the run's own clients: the same train data
        with pytest.raises(UserError, match=r"builds the run's own clients \(the same train data\), which it"):
            place_clients(tmp_path / "r", same)


def test_a_holdout_that_rounds_to_no_client_is_refused_not_ignored():
    # 0.25 of each rotation's 2 clients rounds to 0: the run trained every client and had none to place
    with pytest.raises(
        UserError,
        match=r"scenario.holdout = 0.25 holds out no client \(it rounds to 0 of each "
        r"group's 2 clients\)",
    ):
        build_federation(configure.load(overrides=["scenario.n_clients=8", "scenario.holdout=0.25"]))


def test_clients_csv_holds_each_clients_accuracy_and_the_summary_its_spread(tmp_path):
    import csv

    cfg = configure.load(
        overrides=["algorithm.name=stocfl", "scenario.n_clients=12", "run.rounds=3", "run.sample_rate=0.5"]
    )
    summary = Experiment.create(cfg, tmp_path / "r").run(progress=False)
    rows = list(csv.DictReader((tmp_path / "r" / "clients.csv").open()))
    assert [int(r["client"]) for r in rows] == list(range(12))
    accs = [float(r["accuracy"]) for r in rows]
    samples = [int(r["test_samples"]) for r in rows]
    close = {"abs": 10**-formats.CSV_DECIMALS}  # CSV floats carry CSV_DECIMALS decimals
    assert sum(a * n for a, n in zip(accs, samples)) / sum(samples) == pytest.approx(summary["accuracy"], **close)
    glob = [float(r["global_accuracy"]) for r in rows]
    assert sum(a * n for a, n in zip(glob, samples)) / sum(samples) == pytest.approx(
        summary["global_accuracy"], **close
    )
    assert summary["worst_client_accuracy"] == pytest.approx(min(accs), **close)
    assert min(accs) - 1e-6 <= summary["accuracy_p10"] <= sorted(accs)[2] + 1e-6


@pytest.mark.long
@pytest.mark.parametrize(
    "sig, code, says",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_by_signal_names_the_directory_to_resume(tmp_path, sig, code, says):
    """Ctrl-C, and SIGTERM, what timeout, SLURM and systemd send (it ended a run with no line)."""
    out = tmp_path / "r"
    # as from a shell: Ctrl-C at its default (a test process that ran Ray may ignore SIGINT, and a
    # child inherits an ignored signal: the run then never saw the interrupt)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stocfl", "run", "--quiet", "--out", str(out), "--set", "run.rounds=100000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 60
    metrics = out / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert f"{says}; the last finished round is checkpointed: continue with 'stocfl resume {out}'" in err, err


@pytest.mark.parametrize("prog, args", [("stocfl", ["run", "--quiet"]), ("stocfl-lab", ["bench", "--quick"])])
@pytest.mark.parametrize(
    "sig, code, says",
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_while_the_command_is_still_importing_is_one_line(tmp_path, prog, args, sig, code, says):
    """Ctrl-C in the first second of 'stocfl run', while torch was still being imported, printed a
    27-line KeyboardInterrupt traceback (issue 70, finding 25); SIGTERM ended it with no line."""
    command = os.path.join(os.path.dirname(sys.executable), prog)  # the console script, as a user types it
    proc = subprocess.Popen(
        [command, *args, "--out", str(tmp_path / "r")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # once torch's libraries are mapped, the command is importing (seconds more), past the
    # interpreter's own start (where a signal finds no Python code of ours yet)
    maps, deadline = f"/proc/{proc.pid}/maps", time.monotonic() + 60
    while time.monotonic() < deadline and "libtorch" not in open(maps).read():
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code and err.strip() == f"{prog}: {says} while starting; nothing was run", err
    assert not (tmp_path / "r").exists()


def test_clusters_are_numbered_0_to_k_minus_1_alike_in_every_file(tmp_path):
    import csv

    cfg = configure.load(
        overrides=[
            "algorithm.name=stocfl",
            "scenario.n_clients=16",
            "run.rounds=3",
            "run.sample_rate=0.5",
            "scenario.holdout=0.25",
        ]
    )
    Experiment.create(cfg, tmp_path / "r").run(progress=False)
    clusters = list(csv.DictReader((tmp_path / "r" / "clusters.csv").open()))
    clients = list(csv.DictReader((tmp_path / "r" / "clients.csv").open()))
    heldout = list(csv.DictReader((tmp_path / "r" / "heldout.csv").open()))
    assert [int(c["cluster"]) for c in clusters] == list(range(len(clusters)))
    members = {int(c["cluster"]): int(c["members"]) for c in clusters}
    placed = [int(c["cluster"]) for c in clients if int(c["cluster"]) >= 0]
    assert {k: placed.count(k) for k in set(placed)} == members
    firsts = [min(int(c["client"]) for c in clients if int(c["cluster"]) == k) for k in range(len(clusters))]
    assert firsts == sorted(firsts)  # numbered by lowest member
    assert heldout and all(int(h["cluster"]) in members for h in heldout)
    for row in clusters:  # group:count pairs that add up to the members
        assert sum(int(pair.split(":")[1]) for pair in row["true_groups"].split()) == int(row["members"])


def test_tensorboard_scalars_match_the_metrics_once_per_round_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    out = tmp_path / "r"
    cfg = configure.load(overrides=[*SMALL, "run.rounds=4", "run.tensorboard=true", "algorithm.name=stocfl"])
    Experiment.create(cfg, out).run(progress=False, stop_after=2)
    stray = SummaryWriter(
        str(out / "tensorboard")
    )  # what a run killed after round 3's scalars, before its checkpoint, leaves
    stray.add_scalar("accuracy", 99.0, 3)
    stray.close()
    Experiment.resume(out).run(progress=False)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    for key in ("accuracy", "ari", "coverage", "n_clusters", "objective"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(r["round"], pytest.approx(r[key])) for r in rows if r.get(key) is not None], key


def test_tensorboard_without_a_results_directory_is_refused_in_one_line():
    from stocfl.errors import UserError

    with pytest.raises(UserError, match="run.tensorboard = true writes into the results directory"):
        Experiment.create(configure.load(overrides=["run.tensorboard=true"]), None)


@pytest.mark.parametrize(
    "base, key, other",
    [
        ([], "run.tensorboard", "true"),
        (["algorithm.name=flhc"], "algorithm.cluster_start", "updates"),
        (["algorithm.name=cfl"], "algorithm.cluster_warmup", "5"),
        (["algorithm.name=stocfl"], "algorithm.chain", "true"),
        (["scenario.name=corrupted"], "scenario.severity", "5"),
        (["algorithm.name=cfl"], "algorithm.similarity", "gradients"),
        ([], "run.node_wait", "600"),
        (["algorithm.name=stocfl"], "algorithm.quorum", "0.5"),
        (["algorithm.name=stocfl"], "algorithm.quorum_tau", "0.3"),
        ([], "scenario.validation", "0.1"),
        ([], "run.store_ram", "0"),
        ([], "run.target_accuracy", "0.99"),
        ([], "run.eval_rounds", "[3]"),
        ([], "run.factored_replies", "true"),
    ],
)
def test_a_config_key_added_later_leaves_an_older_runs_digest_as_it_was(base, key, other):
    """Checkpoints and reproduction tables store a digest of the whole config; a key added
    since must not change an older run's digest while it is at its default."""
    import hashlib

    from stocfl.experiment.provenance import config_digest

    cfg = configure.load(overrides=base)
    d = cfg.to_dict()
    d["scenario"].pop("data_dir")
    d["run"].pop("tensorboard")  # every added key at its default, as a run written before them
    d["run"].pop("node_wait")
    d["run"].pop("store_ram")
    d["run"].pop("target_accuracy")
    d["run"].pop("eval_rounds")
    d["run"].pop("factored_replies")
    d["algorithm"].pop("cluster_start", None)
    d["algorithm"].pop("cluster_warmup", None)
    d["algorithm"].pop("chain", None)
    d["algorithm"].pop("quorum", None)
    d["algorithm"].pop("quorum_tau", None)
    d["scenario"].pop("severity")
    d["algorithm"].pop("similarity", None)
    for k in ("present_at_start", "join_rounds", "leave", "leave_rounds", "drift", "drift_rounds"):
        d["scenario"].pop(k)
    for k in ("drift_share", "drift_notice", "validation"):
        d["scenario"].pop(k)
    assert config_digest(cfg) == hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
    assert config_digest(configure.load(overrides=[*base, f"{key}={other}"])) != config_digest(cfg)


@pytest.mark.parametrize("algorithm", ["ditto", "stocfl", "ifca"])
def test_evaluation_in_parts_gives_the_numbers_of_one_part(tmp_path, monkeypatch, algorithm):
    """Client models are evaluated a part at a time (a memory bound); a part of 3 clients
    must give every number and file that evaluating all clients at once gives."""
    from stocfl.experiment import LoadedRun
    from stocfl.experiment import loop as runner
    from stocfl_lab.reproduce import authors_metric

    cfg = [*SMALL, f"algorithm.name={algorithm}"]
    whole = Experiment.create(configure.load(None, cfg), tmp_path / "whole")
    whole.run(progress=False)
    monkeypatch.setattr(runner, "EVAL_MODEL_BYTES", 3 * 4 * len(whole.algorithm.ctx.init_weights))
    parts = Experiment.create(configure.load(None, cfg), tmp_path / "parts")
    parts.run(progress=False)
    assert _metrics(tmp_path / "parts") == _metrics(tmp_path / "whole")
    for name in ("clients.csv", "clusters.csv"):
        assert (tmp_path / "parts" / name).read_text() == (tmp_path / "whole" / name).read_text()
    assert authors_metric(LoadedRun(parts)) == authors_metric(LoadedRun(whole))


def test_a_full_disk_says_where_and_that_the_run_resumes(tmp_path, capsys, monkeypatch):
    import errno

    calls = {"n": 0}
    real = formats.append_jsonl

    def full(path, row):  # the third row's append finds the disk full
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, row)

    monkeypatch.setattr(formats, "append_jsonl", full)
    out = tmp_path / "r"
    assert main(["run", "--quiet", "--out", str(out), *[f"--set={s}" for s in SMALL]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no space left" in err and f"stocfl resume {out}" in err, err


def test_the_progress_bar_shows_the_round_it_counts(tmp_path):
    """The count moved before the round's figures were set: '2/50 acc' showed round 1's accuracy."""
    exp = Experiment.create(configure.load(overrides=SMALL), None)
    shown = []

    class Bar:
        postfix = ""

        def set_postfix_str(self, s, refresh=True):
            self.postfix = s

        def update(self, n):  # tqdm draws here
            shown.append(self.postfix)

    exp._loop(Bar(), None, False, "", None)
    assert shown == [round_line(r) for r in exp.rows]
