"""Crafted representations against StoCFL's clustering, with and without the merge check.

Part 1, the attack. Real MNIST clients (rotated, 400 clients x 50 samples, 4 rotations) send
the default Psi (``update`` of the seeded ``linear`` anchor); the server clusters them as
StoCFL does (arrival in random batches of 40 = 10% per round, tau 0.5). Then an attacker who
knows two true clusters' centroids A and B sends k crafted Psi = unit(unit(A) + unit(B)) in
one round (each re-normalised by the server like any Psi). For every pair of true groups we
find the least k that leaves both groups in one cluster (k is searched up to 1000 by doubling
then bisection, and the answer is checked at k - 1), without the check and with
``leave_out`` = 0.05, 0.1, 0.2.

Part 2, the cost on clean runs: StoCFL on the four MNIST scenarios (the README setting: 400
clients x 50 samples, hybrid 80 x 40, 10% per round, 50 rounds, MLP-200, 1 full-batch epoch, lr
0.1) with and without the check: ARI, clusters and accuracy.

Resumable: every finished measurement is appended to the JSON file given (default
benchmarks/merge_attack.json) and skipped when the script runs again.

    .venv/bin/python benchmarks/merge_attack.py --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from resumable import resumable  # benchmarks/, beside this script

from stocfl.algorithms.stocfl.algorithm import StoCFL
from stocfl.algorithms.stocfl.clustering import ClusterSet
from stocfl.executors import SequentialExecutor, set_threads
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

LEAVE_OUT = (0.0, 0.05, 0.1, 0.2)
TAU = 0.5
K_MAX = 1000
CLEAN = {"pathological": (400, 50), "rotated": (400, 50), "shifted": (400, 50), "hybrid": (80, 40)}


def honest_representations(data_dir: str, seed: int = 0):
    cfg = configure.load(
        overrides=[
            "algorithm.name=stocfl",
            "scenario.dataset=mnist",
            "scenario.name=rotated",
            "scenario.n_clients=400",
            "scenario.samples_per_client=50",
            "model.name=mlp",
            f"run.seed={seed}",
        ],
        data_dir=data_dir,
    )
    exp = Experiment(cfg, Path(tempfile.mkdtemp()))
    alg: StoCFL = exp.algorithm
    ex = SequentialExecutor(exp.fed, exp.model)
    clients = list(range(exp.fed.n_clients))
    psi = torch.stack([r.psi for r in ex.execute([alg.represent_task(i) for i in clients])])
    return psi, np.asarray(exp.fed.groups)


def cluster(psi: torch.Tensor, leave_out: float, seed: int = 0) -> ClusterSet:
    n = len(psi)
    cs = ClusterSet(n + K_MAX, keep_vectors=leave_out > 0)
    order = np.random.default_rng(seed).permutation(n)
    for a in range(0, n, 40):
        cs.merge_greedy([cs.add(int(i), psi[i]) for i in order[a : a + 40]], TAU, leave_out=leave_out)
    return cs


def merged_by(cs: ClusterSet, k: int, craft: torch.Tensor, ga: list[int], gb: list[int], leave_out: float) -> bool:
    tensors, meta = cs.state()
    trial = ClusterSet(len(cs.labels_), keep_vectors=cs.keep_vectors)
    trial.load_state(tensors, meta)
    base = len(cs.labels_) - K_MAX
    trial.merge_greedy([trial.add(base + j, craft) for j in range(k)], TAU, leave_out=leave_out)
    la, lb = trial.labels_[ga], trial.labels_[gb]
    return bool(len(set(la.tolist()) | set(lb.tolist())) == 1)


def least_k(cs: ClusterSet, ga: list[int], gb: list[int], leave_out: float) -> int | None:
    """The least k of crafted Psi that puts groups a and b in one cluster (None: > K_MAX)."""
    ua = cs.unit(int(cs.labels_[ga[0]]))
    ub = cs.unit(int(cs.labels_[gb[0]]))
    craft = ((ua + ub) / (ua + ub).norm()).float()
    hi = 1
    while not merged_by(cs, hi, craft, ga, gb, leave_out):
        if hi >= K_MAX:
            return None
        hi = min(2 * hi, K_MAX)
    lo = hi // 2  # merged at hi; not at lo (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if merged_by(cs, mid, craft, ga, gb, leave_out):
            hi = mid
        else:
            lo = mid
    return hi


def attack(data_dir: str, done: dict, save) -> None:
    psi, groups = honest_representations(data_dir)
    for lo in LEAVE_OUT:
        key = f"attack leave_out={lo}"
        if key in done:
            continue
        t0 = time.perf_counter()
        cs = cluster(psi, lo)
        from sklearn.metrics import adjusted_rand_score

        labels = cs.labels_[: len(psi)]
        row = {
            "leave_out": lo,
            "honest_clusters": len(cs),
            "honest_ari": adjusted_rand_score(groups, labels),
            "refused_honest": None,
            "pairs": {},
        }
        for a in range(4):
            for b in range(a + 1, 4):
                ga = np.flatnonzero(groups == a).tolist()
                gb = np.flatnonzero(groups == b).tolist()
                if len(set(labels[ga].tolist())) != 1 or len(set(labels[gb].tolist())) != 1:
                    row["pairs"][f"{a}-{b}"] = "groups not each one cluster"
                    continue
                row["pairs"][f"{a}-{b}"] = least_k(cs, ga, gb, lo)
        row["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps({key: row}), flush=True)
        save(key, row)


def clean(data_dir: str, done: dict, save, leave_out: float) -> None:
    for scenario, (n, d) in CLEAN.items():
        for lo in (0.0, leave_out):
            key = f"clean {scenario} leave_out={lo}"
            if key in done:
                continue
            cfg = configure.load(
                overrides=[
                    "algorithm.name=stocfl",
                    "scenario.dataset=mnist",
                    f"scenario.name={scenario}",
                    f"scenario.n_clients={n}",
                    f"scenario.samples_per_client={d}",
                    "model.name=mlp",
                    "run.rounds=50",
                    "run.sample_rate=0.1",
                    "run.eval_every=25",
                    "train.epochs=1",
                    "train.batch_size=0",
                    "train.lr=0.1",
                    f"algorithm.leave_out={lo}",
                ],
                data_dir=data_dir,
            )
            s = Experiment.create(cfg, Path(tempfile.mkdtemp()) / "run").run(progress=False)
            row = {k: s[k] for k in ("ari", "n_clusters", "accuracy", "global_accuracy", "seconds")}
            print(json.dumps({key: row}), flush=True)
            save(key, row)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="benchmarks/merge_attack.json")
    p.add_argument("--leave-out", type=float, default=0.1, help="the check's setting measured on clean runs")
    args = p.parse_args(argv)
    set_threads(0)
    done, save = resumable(args.out)

    attack(args.data_dir, done, save)
    clean(args.data_dir, done, save, args.leave_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
