"""A real Flower deployment on 127.0.0.1: one SuperLink, three SuperNodes, `flwr run`."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is part of the test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_stocfl_over_superlink_and_three_supernodes(tmp_path):
    home = tmp_path / "flwr_home"  # never the user's home
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    exp = tmp_path / "exp.toml"
    exp.write_text('[run]\nrounds = 3\nsample_rate = 1.0\n\n[scenario]\nname = "hybrid"\ndataset = "digits"\n'
                   'n_clients = 3\nsamples_per_client = 30\n\n[algorithm]\nname = "stocfl"\n')
    env = dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    procs = []

    def start(args, log):
        p = subprocess.Popen([str(BIN / args[0]), *args[1:]], env=env, stdout=open(tmp_path / log, "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)  # own group: its children die with it
        procs.append(p)
        return p

    try:
        start(["flower-superlink", "--insecure", "--disable-runtime-dependency-installation", "--host", "127.0.0.1",
               "--port", str(port), "--database", ":flwr-in-memory-state:"], "superlink.log")
        _wait_port(port, 60)
        for i in range(3):
            start(["flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--node-config",
                   f"client-id={i}", "--port", str(_free_port())], f"supernode{i}.log")
        out = tmp_path / "results"
        run = subprocess.run(
            [str(BIN / "flwr"), "run", str(ROOT / "flower_app"), "local", "--stream", "--run-config",
             f'config="{exp}" out="{out}" n-clients=3'],
            env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        deadline = time.monotonic() + 120  # --stream may return before the summary is written
        while not (out / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["rounds_done"] == 3 and summary["n_clusters"] == 2 and summary["ari"] == 1.0, summary
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        while any(_alive(p.pid) for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in procs:
            if _alive(p.pid):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    assert not any(_alive(p.pid) for p in procs), "every process started by the test must be gone"
