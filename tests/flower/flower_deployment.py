"""A real Flower deployment on 127.0.0.1 for the tests: a SuperLink, SuperNodes and `flwr run`,
each in its own process group, all stopped by PID when the block ends."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import REPO

ROOT = REPO
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


def alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def kill_group(p: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


class Deployment:
    """``with Deployment(tmp_path, certs=None) as d``: a SuperLink on a free port, insecure, or
    in secure mode with ``certs`` (the files of :func:`stocfl.flower.certs.make_certificates`);
    ``auth``: with SuperNode authentication (secure mode only): only SuperNodes whose public key
    was registered (:meth:`register`) connect, each under its key's node id."""

    def __init__(self, workdir: Path, certs: dict[str, Path] | None = None, auth: bool = False):
        self.dir, self.certs, self.port, self.auth = workdir, certs, free_port(), auth
        self.procs: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}
        home = workdir / "flwr_home"  # never the user's home
        home.mkdir()
        tls = f'root-certificates = "{certs["ca.crt"]}"' if certs else "insecure = true"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\n{tls}\n'
        )
        # The SuperExec of each SuperNode polls for ClientApp tasks every 1 s by default; 0.5 s here.
        self.env = dict(
            os.environ,
            FLWR_HOME=str(home),
            PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}",
            FLWR_SUPEREXEC_TASK_POLL_INTERVAL="0.5",
        )

    def _start(self, args: list[str], log: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [str(BIN / args[0]), *args[1:]],
            env=self.env,
            stdout=open(self.dir / log, "a"),
            stderr=subprocess.STDOUT,
            cwd=self.dir,  # stray files stay in the test's directory
            start_new_session=True,
        )  # own group: its children die with it
        self.procs.append(p)
        return p

    def __enter__(self) -> Deployment:
        tls = (
            [
                "--ssl-ca-certfile",
                str(self.certs["ca.crt"]),
                "--ssl-certfile",
                str(self.certs["server.pem"]),
                "--ssl-keyfile",
                str(self.certs["server.key"]),
            ]
            if self.certs
            else ["--insecure"]
        )
        self._start(
            [
                "flower-superlink",
                *tls,
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *(["--enable-supernode-auth"] if self.auth else []),
            ],
            "superlink.log",
        )  # no --database: state in memory
        wait_port(self.port, 60)
        return self

    def node_key(self, name: str) -> Path:
        """A SuperNode key pair (EC P-384, OpenSSH format, as Flower reads them): ``name``.key and
        ``name``.pub in the test's directory; returns the public key's path."""
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
        (self.dir / f"{name}.key").write_bytes(private)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (self.dir / f"{name}.pub").write_bytes(public)
        return self.dir / f"{name}.pub"

    def register(self, public_key: Path) -> int:
        """``flwr supernode register``: the node id the SuperLink gives that key."""
        p = subprocess.run(
            [str(BIN / "flwr"), "supernode", "register", str(public_key), "local", "--format", "json"],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return int(json.loads(p.stdout)["node-id"])

    def online(self) -> set[int]:
        """The node ids ``flwr supernode list`` reports online."""
        p = subprocess.run(
            [str(BIN / "flwr"), "supernode", "list", "local", "--format", "json"],
            env=self.env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=120,
        )
        nodes = json.loads(p.stdout).get("nodes", []) if p.returncode == 0 else []
        return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}

    def start_supernode(self, clients: str, key: str | None = None) -> subprocess.Popen:
        """A SuperNode serving ``clients``: one id ("2") or ids and ranges ("0-1,5"); ``key``:
        authenticating with the private key ``key``.key (see :meth:`node_key`)."""
        tls = ["--root-certificates", str(self.certs["ca.crt"])] if self.certs else ["--insecure"]
        if key is not None:
            tls += ["--auth-supernode-private-key", str(self.dir / f"{key}.key")]
        config = f'client-ids="{clients}"' if "-" in clients or "," in clients else f"client-id={clients}"
        self.nodes[clients] = self._start(
            [
                "flower-supernode",
                *tls,
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--node-config",
                config,
                "--port",
                str(free_port()),
            ],
            f"supernode{clients}.log",
        )
        return self.nodes[clients]

    def kill_supernode(self, clients: str) -> None:
        """SIGKILL the SuperNode and its SuperExec and ClientApp processes: no goodbye to the SuperLink."""
        p = self.nodes.pop(clients)
        kill_group(p, signal.SIGKILL)
        p.wait(timeout=10)

    def flwr_run(self, experiment: Path, out: Path, n_clients: int, node_keys: Path | None = None) -> subprocess.Popen:
        keys = f' node-keys="{node_keys}"' if node_keys is not None else ""
        return self._start(
            [
                "flwr",
                "run",
                str(ROOT / "flower_app"),
                "local",
                "--stream",
                "--run-config",
                f'config="{experiment}" out="{out}" n-clients={n_clients}{keys}',
            ],
            "flwr_run.log",
        )

    def log(self, name: str) -> str:
        return (self.dir / name).read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            kill_group(p)
        deadline = time.monotonic() + 20
        # poll() reaps each group leader that has exited: a zombie still counts as a member of its group
        while any(p.poll() is None or alive(p.pid) for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in self.procs:
            if alive(p.pid):
                kill_group(p, signal.SIGKILL)
            p.wait(timeout=10)

    def all_stopped(self) -> bool:
        return not any(alive(p.pid) for p in self.procs)


def rows(out: Path) -> list[dict]:
    """The finished lines of ``out``/metrics.jsonl (it may be mid-write while the run goes on)."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def wait_for(condition, seconds: float, what: str, poll: float = 0.3):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {seconds:.0f} s for {what}")
