"""StoCFL on the paper's Rotated MNIST at (N, |D|) = (4800, 50), 10% per round, with all 480
sampled clients of a round batched in one chunk, on the CPU and on an accelerator: the two
must find the same clusters and reach the same accuracy within 1e-3 (issue: any torch device).

One command on a machine with CUDA (the CPU run is the reference; both are resumable run
directories under --out, so a stopped check continues where it stopped):

    .venv/bin/python benchmarks/gpu_check.py --data-dir ../shared/data --rounds 10

Prints and writes (--out/gpu_check.json) each device's seconds per round, the clusters found
(ARI, count) and the accuracy after the last round, and whether they agree. Each device's
outcome is also kept in its run directory (check.json), so the CPU reference can be run on one
machine (``--only-cpu``) and the accelerator's run on another, with that file carried over.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import stocfl  # noqa: E402
from stocfl.devices import describe, resolve_device  # noqa: E402
from stocfl.experiment import configure  # noqa: E402


def one_run(device: str, rounds: int, data_dir: str, out: Path) -> dict:
    if (out / "check.json").is_file():
        kept = json.loads((out / "check.json").read_text())
        if kept["rounds"] == rounds:
            print(f"{device}: the finished run's outcome from {out / 'check.json'}")
            return kept
    cfg = configure.load(
        str(ROOT / "configs" / "rotated_mnist.toml"),
        [
            "algorithm.name=stocfl",
            "scenario.n_clients=4800",
            "scenario.samples_per_client=50",
            f"run.rounds={rounds}",
            "run.engine=lowrank",
            "run.chunk_size=480",
            f"run.device={device}",
            f"run.eval_every={rounds}",
        ],
        data_dir,
    )
    if (out / "config.toml").exists():
        result = stocfl.resume(out, progress=True)
    else:
        result = stocfl.run(cfg, out=out, progress=True)
    seconds = [r["seconds"] for r in result.metrics]
    outcome = {
        "device": device,
        "processor": describe(resolve_device(device)),
        "rounds": rounds,
        "seconds_per_round": float(np.mean(seconds[1:] or seconds)),
        "first_round_seconds": seconds[0],
        "accuracy": result.summary["accuracy"],
        "n_clusters": result.summary["n_clusters"],
        "ari": result.summary["ari"],
        "labels": result.labels.tolist(),
    }
    (out / "check.json").write_text(json.dumps(outcome) + "\n")
    return outcome


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    ap.add_argument("--only-cpu", action="store_true", help="run the CPU reference alone (and stop there)")
    args = ap.parse_args()
    out = Path(args.out)
    runs = {
        d: one_run(d, args.rounds, args.data_dir, out / d.replace(":", "_"))
        for d in (("cpu",) if args.only_cpu else ("cpu", args.device))
    }
    if args.only_cpu:
        print(json.dumps({k: v for k, v in runs["cpu"].items() if k != "labels"}, indent=2))
        return 0
    cpu, acc = runs["cpu"], runs[args.device]
    report = {
        "same_clusters": cpu["labels"] == acc["labels"],
        "accuracy_difference": abs(cpu["accuracy"] - acc["accuracy"]),
        "agree": cpu["labels"] == acc["labels"] and abs(cpu["accuracy"] - acc["accuracy"]) <= 1e-3,
        "speedup": cpu["seconds_per_round"] / acc["seconds_per_round"],
        "runs": {d: {k: v for k, v in r.items() if k != "labels"} for d, r in runs.items()},
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
