"""Same seed, same numbers across a refactor: run a fixed set of configs and record every number
they print (metrics rows and summary, timings and machine names left out), or compare a new
recording with an old one to the bit.

    python benchmarks/numbers_guard.py record OUT.json [--data-dir D] [--only digits]
    python benchmarks/numbers_guard.py check OLD.json NEW.json

The set: all 8 algorithms on the embedded digits default, and on two MNIST configs (rotated,
200 x 50, and Dirichlet label skew, 100 x 500) shortened to a few rounds; the digits StoCFL run
on every in-process engine; the convolutional models (FEMNIST's CNNs, CIFAR-10's on three
engines) for a few rounds. Uses the ``stocfl`` command, so it checks what a user runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ALGORITHMS = ["fedavg", "fedprox", "ditto", "ifca", "cfl", "flhc", "fesem", "stocfl", "fedem", "fedrc", "fedsoft"]
VOLATILE = {
    "seconds",
    "processor",
    "threads_available",
    "started",
    "finished",
    "elapsed",
    "torch",
    "python",
    "host",
    "version",
    "out",
    "data_dir",
    "time",
    "wall_seconds",
}


def cases(only: str | None) -> list[tuple[str, list[str], bool]]:
    out = []
    for a in ALGORITHMS:
        sets = (
            [f"algorithm.name={a}"]
            + (["algorithm.warmup_rounds=5"] if a == "flhc" else [])
            + (["algorithm.warmup=10"] if a == "cfl" else [])
        )
        out.append((f"digits-{a}", ["default.toml", *(f"--set={s}" for s in sets)], False))
    for engine in ("sequential", "parallel", "batched", "lowrank"):
        out.append((f"digits-stocfl-{engine}", ["default.toml", f"--set=run.engine={engine}"], False))
    for cfgname, rounds in (("rotated_mnist_small.toml", 10), ("dirichlet_mnist.toml", 6)):
        for a in ALGORITHMS:
            sets = [f"algorithm.name={a}", f"run.rounds={rounds}", "run.eval_every=2"]
            sets += ["algorithm.warmup_rounds=3"] if a == "flhc" else []
            sets += ["algorithm.warmup=4"] if a == "cfl" else []
            out.append((f"{cfgname.split('.')[0]}-{a}", [cfgname, *(f"--set={s}" for s in sets)], True))
    # the convolutional models, in the layouts and engines they run in (channels-last images of
    # one and three channels, dropout): a few rounds each
    femnist = ["femnist_writers.toml", "--set=run.rounds=3", "--set=run.eval_every=3", "--set=scenario.n_clients=60"]
    out.append(("cnn-femnist-cnn28-fedavg", [*femnist, "--set=algorithm.name=fedavg"], True))
    out.append(
        ("cnn-femnist-dropout-stocfl", [*femnist, "--set=model.name=femnist_cnn", "--set=algorithm.name=stocfl"], True)
    )
    cifar = ["rotated_cifar10.toml", "--set=run.rounds=2", "--set=run.eval_every=2", "--set=scenario.n_clients=40"]
    for engine in ("sequential", "parallel", "batched"):
        out.append((f"cnn-cifar-fedavg-{engine}", [*cifar, f"--set=run.engine={engine}"], True))
    return [c for c in out if only is None or c[0].startswith(only)]


def strip(obj):
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def record(path: Path, data_dir: str | None, only: str | None, stocfl: str, configs: Path) -> None:
    results = json.loads(path.read_text()) if path.exists() else {}
    tmp = Path(tempfile.mkdtemp(prefix="guard-"))
    try:
        for name, argv, needs_data in cases(only):
            if name in results:
                continue
            if needs_data and not data_dir:
                continue
            out = tmp / name
            cmd = [*shlex.split(stocfl), "run", str(configs / argv[0]), *argv[1:], "--out", str(out), "--quiet"]
            if needs_data:
                cmd += ["--data-dir", data_dir]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode:
                results[name] = {"error": p.stderr.strip().splitlines()[-1:]}
            else:
                rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]
                results[name] = {
                    "summary": strip(json.loads((out / "summary.json").read_text())),
                    "metrics": strip(rows),
                    "clients_csv": (out / "clients.csv").read_text(),
                }
            print(
                name, "error" if p.returncode else results[name]["summary"].get("accuracy"), file=sys.stderr, flush=True
            )
            path.write_text(json.dumps(results, indent=1, sort_keys=True))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kept(old: Any, new: Any, added: set[str]) -> Any:
    """``new`` restricted to the keys ``old`` has (dicts, recursively; rows in lists): a figure
    a later version adds is no change of the numbers an earlier one printed. Keys dropped are
    kept as missing, so they count as a difference."""
    if isinstance(old, dict) and isinstance(new, dict):
        added.update(k for k in new if k not in old)
        return {k: _kept(old[k], new.get(k, "<missing>"), added) for k in old}
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [_kept(a, b, added) for a, b in zip(old, new)]
    return new


def check(old: Path, new: Path) -> int:
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    bad = missing = 0
    added: set[str] = set()
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'new' if name in b else 'old'}")
            missing += 1
            continue
        x, y = a[name], _kept(a[name], b[name], added)
        if x != y:
            diff = [
                k
                for k in sorted(set(x.get("summary", {})) | set(y.get("summary", {})))
                if x.get("summary", {}).get(k) != y.get("summary", {}).get(k)
            ]
            print(f"{name}: differs (summary keys {diff}; metrics equal: {x.get('metrics') == y.get('metrics')})")
            bad += 1
    if added:
        print(f"figures the new recording adds (not compared): {', '.join(sorted(added))}")
    print(f"{len(set(a) & set(b)) - bad} equal, {bad} differ, {missing} in one recording only")
    return 1 if bad or missing else 0


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--data-dir", default=os.environ.get("STOCFL_DATA_DIR"))
    r.add_argument("--only")
    r.add_argument(
        "--stocfl", default=f"{sys.executable} -m stocfl", help="the command to run (default: this Python's stocfl)"
    )
    r.add_argument("--configs", type=Path, default=Path(__file__).resolve().parents[1] / "configs")
    c = sub.add_parser("check")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    args = p.parse_args()
    if args.cmd == "record":
        record(args.out, args.data_dir, args.only, args.stocfl, args.configs)
        return 0
    return check(args.old, args.new)


if __name__ == "__main__":
    raise SystemExit(main())
