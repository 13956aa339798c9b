"""Run files damaged between a stop and a resume: every file of a stopped run (config,
metrics, checkpoint, a per-client store and its undo log) emptied, cut in half or with one
bit flipped at several places. A resume either refuses with one line and exit code 2, or
finishes with exactly the results of an uninterrupted run; never a traceback, never other
results."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.cli import main
from stocfl.errors import UserError
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment
from stocfl.storage import files

SMALL = [
    "scenario.n_clients=12",
    "scenario.samples_per_client=20",
    "run.rounds=5",
    "run.sample_rate=0.5",
    "run.engine=sequential",
]


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k != "seconds"}
    return obj


def _results(d):
    rows = [_strip(json.loads(x)) for x in (d / "metrics.jsonl").read_text().splitlines()]
    return rows, _strip(json.loads((d / "summary.json").read_text()))


_runs: dict[str, tuple] = {}


def stopped_run(algorithm: str, factory):
    """(the pristine run stopped after round 3 of 5, the results of the uninterrupted run);
    ``ditto-disk``: Ditto with its store beyond run.store_ram (a mapped file and an undo log)."""
    if algorithm not in _runs:
        root = factory.mktemp(algorithm)
        name, disk = algorithm.removesuffix("-disk"), algorithm.endswith("-disk")
        sets = [*SMALL, f"algorithm.name={name}", *(["run.store_ram=0"] if disk else [])]
        cfg = lambda: configure.load(overrides=sets)  # noqa: E731
        Experiment.create(cfg(), root / "ref").run(progress=False)
        assert Experiment.create(cfg(), root / "stopped").run(progress=False, stop_after=3) is None
        _runs[algorithm] = (root / "stopped", _results(root / "ref"))
    return _runs[algorithm]


@pytest.fixture(params=["stocfl", "ditto", "ditto-disk"])
def runs(request, tmp_path_factory):
    return stopped_run(request.param, tmp_path_factory)


def _corruptions(size: int):
    yield "empty", lambda b: b""
    yield "half", lambda b: b[: len(b) // 2]
    for frac in (0.0, 0.05, 0.3, 0.5, 0.8, 1.0):
        pos = min(size - 1, int(frac * size))
        yield f"flip@{pos}", lambda b, pos=pos: b[:pos] + bytes([b[pos] ^ 0x10]) + b[pos + 1 :]


RUN_FILES = ["config.toml", "metrics.jsonl", "checkpoint.safetensors"]
# Ditto's per-client models: in memory with a journal (within run.store_ram), or a mapped file
# with an undo log (beyond it)
STORE_FILES = {
    "ditto": ["ditto_personal.journal"],
    "ditto-disk": ["ditto_personal.f32", "ditto_personal.undo.safetensors"],
}


@pytest.mark.parametrize(
    "algorithm, name",
    [
        *(("stocfl", f) for f in RUN_FILES),
        *(("ditto", f) for f in RUN_FILES + STORE_FILES["ditto"]),
        *(("ditto-disk", f) for f in STORE_FILES["ditto-disk"]),
    ],
)
def test_a_damaged_run_file_is_refused_or_harmless(algorithm, name, tmp_path_factory, tmp_path, capsys):
    pristine, (ref_rows, ref_summary) = stopped_run(algorithm, tmp_path_factory)
    assert (pristine / name).is_file()
    outcomes = {}
    data = (pristine / name).read_bytes()
    for label, damage in _corruptions(len(data)):
        run = tmp_path / label
        shutil.copytree(pristine, run)
        (run / name).write_bytes(damage(data))
        capsys.readouterr()
        code = main(["resume", "--quiet", str(run)])
        err = capsys.readouterr().err.strip()
        if code == 2:
            assert err.startswith("stocfl: error:") and "\n" not in err, err
            outcomes[label] = "refused"
        else:
            assert code == 0 and _results(run) == (ref_rows, ref_summary), f"{name} {label}: other results"
            outcomes[label] = "same results"
    # the damage that matters is always noticed
    assert outcomes["empty"] == outcomes["half"] == "refused", outcomes


def test_resume_refuses_a_config_that_is_not_the_runs(runs, tmp_path, capsys):
    pristine, _ = runs
    run = tmp_path / "edited"
    shutil.copytree(pristine, run)
    text = (run / "config.toml").read_text()
    (run / "config.toml").write_text(text.replace("rounds = 5", "rounds = 7").replace("seed = 0", "seed = 1"))
    assert main(["resume", "--quiet", str(run)]) == 2
    assert "does not match the run's checkpoint" in capsys.readouterr().err


def test_resume_drops_rows_a_kill_left_after_the_checkpoint(runs, tmp_path):
    pristine, (ref_rows, ref_summary) = runs
    run = tmp_path / "extra"
    shutil.copytree(pristine, run)
    with open(run / "metrics.jsonl", "a") as f:  # round 4 was written, its checkpoint was not
        f.write(json.dumps({"round": 4, "accuracy": 0.5}) + "\n" + '{"round": 5, "accur')
    assert main(["resume", "--quiet", str(run)]) == 0
    assert _results(run) == (ref_rows, ref_summary)


def test_write_atomic_leaves_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "f.txt"
    files.write_atomic(path, "old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(files.os, "replace", boom)
    with pytest.raises(OSError):
        files.write_atomic(path, "new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.txt"]  # no temporary file left behind


def _write_many(path: str, tag: str) -> None:
    for k in range(200):
        files.write_atomic(Path(path), f"{tag} {k} " * 2000)


@pytest.mark.long
def test_two_processes_writing_one_file_never_collide_and_leave_a_whole_version(tmp_path):
    import multiprocessing

    path = tmp_path / "table.json"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(str(path), tag)) for tag in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]  # with one shared temporary name, one renamed the other's away
    words = path.read_text().split()
    assert len(words) == 4000 and len(set(words[:2])) == 2 and words == words[:2] * 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.json"]


@pytest.mark.long
def test_a_journal_the_disk_cannot_hold_is_one_line_and_the_run_resumes_to_the_same_numbers(tmp_path):
    """Within run.store_ram, Ditto's personal models live in memory and each round's rows are
    appended to a journal: a disk that fills mid-run (the file-size limit, RLIMIT_FSIZE) stops the
    run at its last checkpoint in one line, and with room it resumes to the uninterrupted run's
    numbers (the record cut short by the full disk is dropped)."""
    import resource
    import subprocess
    import sys

    limit = 200_000  # the journal of 30 rounds of 4 clients x 9,640 bytes outgrows it by round 6
    cmd = [sys.executable, "-m", "stocfl", "run", "configs/default.toml", "--quiet", "--set", "algorithm.name=ditto"]
    cmd += ["--set", "run.rounds=30", "--set", "run.eval_every=10"]
    full = subprocess.run(
        [*cmd, "--out", str(tmp_path / "cut")],
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
        timeout=300,
    )
    assert full.returncode == 2, full.stderr
    line = full.stderr.strip()
    assert line.startswith(f"stocfl: error: {tmp_path / 'cut' / 'ditto_personal.journal'}: cannot append"), line
    assert "\n" not in line and line.endswith("free disk space, then resume the run")
    resumed = subprocess.run(
        [sys.executable, "-m", "stocfl", "resume", "--quiet", str(tmp_path / "cut")], capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    ref = subprocess.run([*cmd, "--out", str(tmp_path / "ref")], capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    assert _results(tmp_path / "cut") == _results(tmp_path / "ref")


@pytest.mark.long
def test_a_client_store_the_disk_cannot_hold_is_one_line_before_the_first_round(tmp_path):
    """Ditto's personal models get their disk blocks when the run starts: a write through the
    memory map into a sparse file on a full disk would kill the process (SIGBUS) mid-round
    without a word. The file-size limit (RLIMIT_FSIZE) makes the disk too small for real."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "run"
    limit = 200_000  # the store of 40 clients x the digits MLP is 385,600 bytes; every other run file is smaller

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    cmd = [
        sys.executable,
        "-m",
        "stocfl",
        "run",
        "configs/default.toml",
        "--set",
        "algorithm.name=ditto",
        "--set",
        "run.rounds=2",
        "--set",
        "run.store_ram=0",  # beyond the budget: a file mapped from the run directory
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=small_disk, timeout=300)
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(
        f"stocfl: error: {out / 'ditto_personal.f32'}: cannot reserve 0.37 MiB for 40 clients x 2410 parameters x 4 "
        "bytes (File too large)"
    )
    assert line.endswith(
        "; free disk space, give the run a directory on a larger disk, or run fewer clients or a smaller model"
    )
    assert not (out / "ditto_personal.f32").exists() and not (out / "checkpoint.safetensors").exists()
    # with room, the same command runs, and its store is allocated, not sparse
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    store = out / "ditto_personal.f32"
    assert store.stat().st_blocks * 512 >= store.stat().st_size > limit


@pytest.mark.long
def test_a_run_directory_is_written_by_one_process_at_a_time(tmp_path, capsys):
    """Two writers of one run (a second 'stocfl resume', or two reproductions given the same
    row) would interleave its metrics and checkpoints. A real process runs; this one is refused
    in one line naming it, and continues the run once it is gone."""
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "stocfl",
        "run",
        "--quiet",
        "--out",
        str(out),
        "--set",
        "run.rounds=400",
        "--set",
        "run.engine=sequential",
        "--set",
        "run.threads=1",
        "--set",
        "algorithm.name=fedavg",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # two metrics rows: round 1's checkpoint is written after its row and before round 2's, so a
        # kill after one row (a loaded machine can make it land there) could leave no round to resume
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.05)
        assert files.holder(out) == proc.pid  # what a reproduction's table says of a row another process runs
        assert main(["resume", "--quiet", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"is in use by another process (pid {proc.pid})" in err, err
        with pytest.raises(UserError, match="in use by another process"):
            Experiment.resume(out, overrides=["run.rounds=500"])
        # nor does an export, a placement or a loaded run read beside it: opening a store puts back
        # rows newer than the checkpoint through the map the run writes (a Ditto run ended at 13%)
        for command in (["export", str(out)], ["assign", str(out)]):
            assert main(command) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and f"is in use by another process (pid {proc.pid})" in err, err
        with pytest.raises(UserError, match="in use by another process"):
            Experiment.open(out)
        with files.exclusive(tmp_path):  # another directory is free; this process may take its own lock again
            with files.exclusive(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait(60)
    # the holder died (SIGKILL): the system dropped its lock, and the run continues where it stopped
    assert files.holder(out) is None
    stopped = Experiment.open(out).round
    assert stopped >= 1
    resumed = Experiment.resume(out, overrides=[f"run.rounds={stopped + 1}"])
    assert resumed.run(progress=False)["rounds_done"] == stopped + 1


TAILS = {  # what a kill, a full disk or a crash may leave after the checkpoint's rows
    "a row cut short": b'{"round": 4, "accur',
    "NUL bytes": b"\x00" * 37,
    "a byte that is not UTF-8": b'{"round": 4, "note": "\xff"}\n',
    "a whole row and a cut one": b'{"round": 4, "accuracy": 0.5}\n{"round": 5',
    "a row that is not an object": b"[4, 0.5]\n",
    "a newline only": b"\n",
}


@pytest.mark.parametrize("tail", list(TAILS))
def test_resume_truncates_metrics_to_the_checkpoints_rows_whatever_the_tail(runs, tmp_path, tail):
    """A partial last row used to be kept and the resumed rows appended on its line: the
    finished run then read back fewer rows and could never be extended."""
    pristine, (ref_rows, ref_summary) = runs
    run = tmp_path / "tail"
    shutil.copytree(pristine, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(TAILS[tail])
    assert main(["resume", "--quiet", str(run)]) == 0
    assert _results(run) == (ref_rows, ref_summary)


EDITS = {
    "a byte that is not UTF-8": lambda t: t.encode() + b"\n# \xff\xfe\n",
    "a section that is a number": lambda t: ("run = 5\n" + t.replace("[run]", "[run_was]", 1)).encode(),
    "a key that is a table": lambda t: t.replace("rounds = 5", "rounds = {a = 1}").encode(),
    "the scenario section gone": lambda t: t.replace("[scenario]", "[nothing]").encode(),
}


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("command", [["resume", "--quiet"], ["export"], ["assign"]])
def test_an_edited_config_toml_is_one_line_for_every_command(tmp_path_factory, tmp_path, capsys, edit, command):
    pristine, _ = stopped_run("stocfl", tmp_path_factory)
    run = tmp_path / "edited"
    shutil.copytree(pristine, run)
    (run / "config.toml").write_bytes(EDITS[edit]((run / "config.toml").read_text()))
    capsys.readouterr()
    assert main([*command, str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stocfl: error:") and "\n" not in err and "config.toml" in err, err


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30))
def test_the_toml_writer_reads_back_any_text(text):
    """Non-BMP characters (JSON's surrogate-pair escapes are not TOML), controls, DEL, quotes."""
    import tomllib

    from stocfl.storage.formats import to_toml

    for s in (text, f"/data/\U0001f600{text}\x7f\x01\"'\\"):
        assert tomllib.loads(to_toml({"scenario": {"data_dir": s}}))["scenario"]["data_dir"] == s


def test_a_path_with_bytes_that_are_not_utf8_is_one_line():
    from stocfl.storage.formats import to_toml

    with pytest.raises(UserError, match="not UTF-8"):
        to_toml({"scenario": {"data_dir": "/data/\udcff"}})


@pytest.mark.parametrize("name", [".lock", "metrics.jsonl", "ditto_personal.f32"])
def test_a_run_file_that_is_a_symlink_is_never_written_through(tmp_path_factory, tmp_path, capsys, name):
    """A link in a run directory to a file elsewhere: the lock used to truncate it and write the
    pid, the metrics were appended to it, a store mapped and rewritten it."""
    pristine, _ = stopped_run("ditto", tmp_path_factory)
    run = tmp_path / "linked"
    shutil.copytree(pristine, run)
    victim = tmp_path / "victim.bin"
    original = (run / name).read_bytes() if (run / name).exists() else b"precious\n"
    victim.write_bytes(original)
    (run / name).unlink(missing_ok=True)
    (run / name).symlink_to(victim)
    capsys.readouterr()
    assert main(["resume", "--quiet", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "symbolic link" in err, err
    assert victim.read_bytes() == original


def test_an_edited_summary_is_not_taken_as_the_runs(tmp_path, capsys):
    """A finished run's summary.json was trusted as it stood: edit its accuracy and resume
    printed the edited figure. It is now under the checkpoint's digests: resume writes it anew."""
    out = tmp_path / "r"
    assert main(["run", "--quiet", "--out", str(out), *[f"--set={s}" for s in SMALL]]) == 0
    true = json.loads((out / "summary.json").read_text())
    assert files_finished(out)["accuracy"] == true["accuracy"]
    edited = dict(true, accuracy=0.999)
    (out / "summary.json").write_text(json.dumps(edited))
    assert files_finished(out) is None
    capsys.readouterr()
    assert main(["resume", "--quiet", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert printed["accuracy"] == true["accuracy"] != 0.999
    assert _strip(json.loads((out / "summary.json").read_text())) == _strip(true)


def files_finished(out):
    from stocfl.experiment.provenance import finished_summary

    return finished_summary(out)


def _resign(path: Path, meta_edit=None, tensor_edit=None, header_edit=None) -> None:
    """Rewrite a checkpoint with its state (and tensors, and safetensors header) edited, its
    checksum recomputed over the edit: what someone who edits a file deliberately can do."""
    from safetensors import safe_open
    from safetensors.torch import save as to_bytes

    from stocfl.storage.checkpoint import digest

    with safe_open(str(path), framework="pt") as f:
        header = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["stocfl"])
    if meta_edit:
        meta_edit(meta)
    if tensor_edit:
        tensor_edit(tensors)
    header["stocfl"] = json.dumps(meta)
    header["sha256"] = digest(tensors, header["stocfl"])
    if header_edit:
        header_edit(header)
    path.write_bytes(to_bytes(tensors, metadata=header))


def _drop(*keys):
    return lambda d: [d.pop(k, None) for k in keys]


CHECKSUM_EDITS = {  # (how the checkpoint is edited, what the one line says)
    "no sha256": (dict(header_edit=_drop("sha256")), "carries no checksum"),
    "no sha256, no digests": (
        dict(
            meta_edit=_drop("config_sha256", "config_core_sha256", "metrics_sha256", "data_sha256"),
            header_edit=_drop("sha256"),
        ),
        "carries no checksum",
    ),
    "a short sha256": (dict(header_edit=lambda h: h.update(sha256="abc")), "carries no checksum"),
    "format 2 without its digests": (
        dict(meta_edit=_drop("config_sha256", "metrics_sha256", "data_sha256")),
        "lacks config_sha256, metrics_sha256, data_sha256",
    ),
    "format 3": (dict(meta_edit=lambda m: m.update(format=3)), "format this version of stocfl does not read"),
    "format 'x'": (dict(meta_edit=lambda m: m.update(format="x")), "format this version of stocfl does not read"),
    "state not an object": (dict(header_edit=lambda h: h.update(stocfl="[1]")), "unreadable"),
}


@pytest.mark.parametrize("edit", list(CHECKSUM_EDITS))
def test_a_checkpoint_without_its_checksums_is_refused(runs, tmp_path, capsys, edit):
    """Finding 12: the checksum and the digests were each checked only when present, so a
    checkpoint edited to drop them resumed to other numbers. This version's checkpoints say
    their format and carry every checksum; one that lacks one is refused in one line."""
    pristine, _ = runs
    run = tmp_path / "edited"
    shutil.copytree(pristine, run)
    how, says = CHECKSUM_EDITS[edit]
    _resign(run / "checkpoint.safetensors", **how)
    capsys.readouterr()
    for command in (["resume", "--quiet"], ["export"], ["assign"]):
        assert main([*command, str(run)]) == 2, (edit, command)
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and says in err, err


def test_a_format_1_checkpoint_resumes_by_the_rules_it_was_written_under(runs, tmp_path):
    """A checkpoint of format 1 (written before checkpoints said their format) declares no
    format and may lack the digests added since; it resumes, its checksum checked."""
    pristine, (ref_rows, ref_summary) = runs
    run = tmp_path / "older"
    shutil.copytree(pristine, run)

    def older(meta):
        meta.pop("format")
        meta.pop("data_sha256")
        for part in meta.values():
            if isinstance(part, dict):
                for v in part.values():
                    if isinstance(v, dict):
                        v.pop("format", None)

    _resign(run / "checkpoint.safetensors", meta_edit=older)
    assert main(["resume", "--quiet", str(run)]) == 0
    assert _results(run) == (ref_rows, ref_summary)


def test_a_client_store_without_its_row_checksums_is_refused(tmp_path_factory, tmp_path, capsys):
    """A format-2 store state with its rows' CRCs removed is refused, never read unchecked."""
    pristine, _ = stopped_run("ditto", tmp_path_factory)
    run = tmp_path / "edited"
    shutil.copytree(pristine, run)
    _resign(run / "checkpoint.safetensors", tensor_edit=lambda t: [t.pop(k) for k in list(t) if k.endswith("crc")])
    assert main(["resume", "--quiet", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no checksums for them" in err, err


def test_a_finished_run_whose_summary_digest_was_dropped_is_not_taken_as_finished(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["run", "--quiet", "--out", str(out), *[f"--set={s}" for s in SMALL]]) == 0
    true = json.loads((out / "summary.json").read_text())
    (out / "summary.json").write_text(json.dumps(dict(true, accuracy=0.999)))
    _resign(out / "checkpoint.safetensors", meta_edit=_drop("summary_sha256"))
    assert files_finished(out) is None
    capsys.readouterr()
    assert main(["resume", "--quiet", str(out)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["accuracy"] == true["accuracy"]


def _bytes_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("form", ["ditto", "ditto-disk"])
def test_export_assign_and_a_loaded_run_change_no_byte_of_the_run(form, tmp_path_factory, tmp_path, capsys):
    """Issue 70, finding 15: reading a run wrote to it (opening a store put back rows newer than
    the checkpoint, through the shared map). Export, assign and a loaded run now read the stores
    copy-on-write: a Ditto run killed between its store write and its checkpoint keeps every
    byte, and its models read back as the checkpoint's; resume then puts the rows back itself."""
    import torch

    from stocfl.storage.store import ClientStore

    pristine, (ref_rows, ref_summary) = stopped_run(form, tmp_path_factory)
    run = tmp_path / "killed"
    shutil.copytree(pristine, run)
    # what a kill between round 4's store write and its checkpoint leaves: newer rows, an undo file
    personal = Experiment.open(run).algorithm.state.personal  # read-only: the checkpoint's models
    want = {i: personal.get(i).clone() for i in range(personal.n) if i in personal}
    live = ClientStore(personal.n, personal.p, run, "ditto_personal", 0 if form == "ditto-disk" else 2**30)
    live.load_state(*personal.state())
    live.write({i: torch.full((personal.p,), 7.0) for i in want})
    del live
    before = _bytes_of(run)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    assert main(["assign", str(run)]) in (0, 2)  # what assign says about placing matters not here
    import stocfl

    got = Experiment.open(run).algorithm.state.personal
    assert stocfl.open_run(run).load().global_model() is not None
    assert all(torch.equal(got.get(i), w) for i, w in want.items()), "the checkpoint's models, not the killed write's"
    assert _bytes_of(run) == before, "reading a run changed its files"
    assert main(["resume", "--quiet", str(run)]) == 0
    assert _results(run) == (ref_rows, ref_summary)
