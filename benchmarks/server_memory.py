"""Server memory of StoCFL at scale: N = 1,000 to 100,000 clients of tiny synthetic data.

Each N runs in a fresh process (peak RSS is per process): StoCFL, 1% of the clients per
round, a few rounds, every client evaluated at the end, in memory (``out=None``), with
``keep_representations = false`` (the per-client Psi kept for plots would be N x 1,024 floats).
Reported per N: peak RSS, RSS after the federation is built (the simulated clients' data,
which a deployment keeps on the clients), and the size of the server's state as checkpointed:
tensor bytes and the count of integers and floats in its JSON part.

    .venv/bin/python benchmarks/server_memory.py            # N = 1,000, 10,000, 100,000
    .venv/bin/python benchmarks/server_memory.py 100000     # one N

Resumable: results are appended to benchmarks/server_memory.json as each N finishes, and an
N already there is skipped.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "server_memory.json"


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def count_numbers(meta) -> tuple[int, int]:
    if isinstance(meta, bool) or meta is None or isinstance(meta, str):
        return 0, 0
    if isinstance(meta, int):
        return 1, 0
    if isinstance(meta, float):
        return 0, 1
    items = meta.values() if isinstance(meta, dict) else meta
    ints = floats = 0
    for v in items:
        i, f = count_numbers(v)
        ints, floats = ints + i, floats + f
    return ints, floats


def measure(n: int) -> dict:
    import numpy as np
    import torch

    import stocfl
    from stocfl.experiment.loop import Experiment

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    d, k, per, test = 16, 4, 4, 2
    means = rng.normal(0, 3, (k, d)).astype(np.float32)
    groups = np.arange(n) % k
    train, tests = [], []
    for i in range(n):
        g = groups[i]
        train.append((means[g] + rng.normal(0, 1, (per, d)).astype(np.float32), rng.integers(0, 4, per) + 4 * (g % 2)))
        tests.append(
            (means[g] + rng.normal(0, 1, (test, d)).astype(np.float32), rng.integers(0, 4, test) + 4 * (g % 2))
        )
    fed = stocfl.Federation.from_arrays(train, tests, groups.tolist(), n_classes=8)
    del train, tests
    after_data = rss_mib()
    rounds = 3
    cfg = stocfl.as_config(
        {
            "algorithm": {"name": "stocfl", "keep_representations": False, "psi_epochs": 2},
            "run": {"rounds": rounds, "sample_rate": 0.01, "eval_every": rounds, "engine": "batched"},
            "train": {"epochs": 1, "batch_size": 0, "lr": 0.1},
            "model": {"name": "digits_mlp"},
        }
    )
    t = time.perf_counter()
    exp = Experiment.create(cfg, None, federation=fed)
    summary = exp.run(progress=False)
    seconds = time.perf_counter() - t
    tensors, meta = exp.algorithm.encode_state()
    ints, floats = count_numbers(meta)
    return {
        "n_clients": n,
        "rounds": rounds,
        "sampled_per_round": exp.sample_size(),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_after_data_mib": round(after_data, 1),
        "seconds": round(seconds, 2),
        "state_tensor_bytes": int(sum(t.numel() * t.element_size() for t in tensors.values())),
        "state_json_ints": ints,
        "state_json_floats": floats,
        "clusters": summary["n_clusters"],
        "ari": summary["ari"],
        "accuracy": summary["accuracy"],
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(measure(int(sys.argv[2]))))
        return 0
    sizes = [int(a) for a in sys.argv[1:]] or [1_000, 10_000, 100_000]
    done = json.loads(OUT.read_text()) if OUT.exists() else []
    for n in sizes:
        if any(r["n_clients"] == n for r in done):
            continue
        line = (
            subprocess.run([sys.executable, __file__, "--one", str(n)], check=True, capture_output=True, text=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        done.append(json.loads(line))
        done.sort(key=lambda r: r["n_clients"])
        OUT.write_text(json.dumps(done, indent=2) + "\n")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
