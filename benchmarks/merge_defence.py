"""StoCFL's merge checks against colluding clients that send crafted representations (issue 70,
finding 8): how many colluders it takes to merge two true clusters under each check, and what
each check costs a clean clustering.

The attack (as in benchmarks/merge_attack.py, on the small federation of the finding): 40 real
MNIST clients (rotated, 4 rotations x 10 clients, 50 samples each) send StoCFL's default Psi
(``update`` of the seeded ``linear`` anchor); the server clusters them as StoCFL does (arrival
in random batches of 4 = 10% a round, tau 0.5). Then k colluders who know two true clusters'
representations u_A and u_B each send Psi = unit(u_A + u_B) in one round ("late"), or in the
first round beside the first honest clients ("early", with u_A, u_B the true groups' mean
Psi). A run is merged when every member of A and B ends in one cluster. Runs: the 6 pairs of
groups x 3 federations (data seeds 0-2) = 18 a cell.

The cost: the same clustering without an attacker, ARI and clusters, on the four MNIST scenarios
of the README setting (400 clients x 50 samples, hybrid 80 x 40) and on the 40-client
federations, 5 arrival orders each. StoCFL's representation does not depend on the trained
models, so the clustering of a run is this clustering of its Psi in its arrival order: these are
the clean runs' clustering figures, without their training.

Resumable: each finished cell is written to the JSON file (default
benchmarks/merge_defence.json) and skipped when the script runs again.

    .venv/bin/python benchmarks/merge_defence.py --data-dir ../shared/data
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
from sklearn.metrics import adjusted_rand_score

from stocfl.algorithms.stocfl.clustering import ClusterSet
from stocfl.executors import SequentialExecutor, set_threads
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

TAU = 0.5
SETTINGS = {
    "none": {},
    "leave_out 0.1": {"leave_out": 0.1},
    "leave_out 0.3": {"leave_out": 0.3},
    "leave_out 0.45": {"leave_out": 0.45},
    "quorum 0.5": {"quorum": 0.5},
    "quorum 0.5 at 0.25": {"quorum": 0.5, "quorum_tau": 0.25},
    "quorum 0.5 at 0.35": {"quorum": 0.5, "quorum_tau": 0.35},
    "quorum 0.5 at 0.35 + leave_out 0.1": {"quorum": 0.5, "quorum_tau": 0.35, "leave_out": 0.1},
}
# the federations attacked: 40 clients in 4 rotations, 3 data seeds each; digits (30 samples a
# client) is stocfl's default config, the one of the finding
ATTACKED = {"": ("mnist", 50), "digits: ": ("digits", 30)}
COLLUDERS = (1, 2, 3, 4, 6, 8, 10, 12, 16)
CLEAN = {"pathological": (400, 50), "rotated": (400, 50), "shifted": (400, 50), "hybrid": (80, 40)}


def representations(
    data_dir: str, scenario: str, n: int, d: int, seed: int, dataset: str = "mnist"
) -> tuple[torch.Tensor, np.ndarray]:
    cfg = configure.load(
        overrides=[
            "algorithm.name=stocfl",
            f"scenario.dataset={dataset}",
            f"scenario.name={scenario}",
            f"scenario.n_clients={n}",
            f"scenario.samples_per_client={d}",
            "model.name=mlp",
            f"run.seed={seed}",
        ],
        data_dir=data_dir if dataset != "digits" else None,
    )
    exp = Experiment(cfg, Path(tempfile.mkdtemp()))
    ex = SequentialExecutor(exp.fed, exp.model)
    replies = ex.execute([exp.algorithm.represent_task(i) for i in range(exp.fed.n_clients)])
    psi = torch.stack([r.psi / r.psi.norm() for r in replies])  # the server re-normalises every Psi
    return psi, np.asarray(exp.fed.groups)


def cluster(psi, order, setting: dict, extra=None, early: bool = False) -> ClusterSet:
    """Honest clients arrive in ``order``, 4 (10% of 40) or 40 (of 400) a round; ``extra`` (the
    crafted Psi) arrive in the round after the last honest one, or with the first (``early``)."""
    n = len(psi)
    size = max(1, n // 10)
    extra = [] if extra is None else extra
    cs = ClusterSet(n + len(extra), keep_vectors=bool(setting))
    rounds = [[(int(i), psi[i]) for i in order[a : a + size]] for a in range(0, n, size)]
    crafted = [(n + j, v) for j, v in enumerate(extra)]
    if crafted:
        rounds = [crafted + rounds[0], *rounds[1:]] if early else [*rounds, crafted]
    for batch in rounds:
        cs.merge_greedy([cs.add(i, v) for i, v in batch], TAU, **setting)
    return cs


def attack_cell(feds, setting: dict, k: int, early: bool) -> dict:
    merged, runs = 0, 0
    for seed, (psi, groups) in enumerate(feds):
        order = np.random.default_rng(seed).permutation(len(psi))
        for a in range(4):
            for b in range(a + 1, 4):
                ua, ub = psi[groups == a].double().mean(0), psi[groups == b].double().mean(0)
                craft = (ua / ua.norm() + ub / ub.norm()).float()
                craft = craft / craft.norm()
                cs = cluster(psi, order, setting, [craft] * k, early)
                ga, gb = np.flatnonzero(groups == a), np.flatnonzero(groups == b)
                merged += len(set(cs.labels_[ga].tolist()) | set(cs.labels_[gb].tolist())) == 1
                runs += 1
    return {"merged": merged, "runs": runs}


def clean_cell(psi, groups, setting: dict, orders: int = 5) -> dict:
    aris, ks = [], []
    for seed in range(orders):
        cs = cluster(psi, np.random.default_rng(seed).permutation(len(psi)), setting)
        aris.append(adjusted_rand_score(groups, cs.labels_[: len(psi)]))
        ks.append(len(cs))
    return {"ari": round(float(np.mean(aris)), 4), "ari_min": round(float(np.min(aris)), 4), "clusters": ks}


def table(done: dict, prefix: str, ks=(3, 4, 6, 8, 10, 12), early=(6, 10)) -> str:
    """The docs' table for one attacked federation: per setting, the clean ARI and, per number of
    colluders, the runs (of 18) in which two true clusters were merged."""
    head = ["setting", "clean ARI (min)"] + [f"late k={k}" for k in ks] + [f"early k={k}" for k in early]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in SETTINGS:
        c = done.get(f"{prefix}clean 40 rotated / {name}")
        if c is None:
            continue
        cells = [f"`{name}`", f"{c['ari']:.3f} ({c['ari_min']:.3f})"]
        for when, kk in (("late", ks), ("early", early)):
            for k in kk:
                r = done.get(f"{prefix}attack {when} k={k} / {name}")
                cells.append("pending" if r is None else f"{r['merged']}/{r['runs']}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--out", default="benchmarks/merge_defence.json")
    p.add_argument("--table", action="store_true", help="print the docs' tables from the JSON file and stop")
    args = p.parse_args(argv)
    if args.table:
        done = json.loads(Path(args.out).read_text())
        for prefix, (dataset, _) in ATTACKED.items():
            print(f"{dataset}:\n{table(done, prefix)}\n")
        clean = [(k, v) for k, v in done.items() if k.startswith("clean ") and "x" in k.split(" / ")[0]]
        print("\n".join(f"{k}: ARI {v['ari']:.3f} (min {v['ari_min']:.3f})" for k, v in clean))
        return 0
    set_threads(0)
    done, save = resumable(args.out, echo=True)

    for prefix, (dataset, d) in ATTACKED.items():
        feds = [representations(args.data_dir, "rotated", 40, d, seed, dataset) for seed in range(3)]
        for name, setting in SETTINGS.items():
            key = f"{prefix}clean 40 rotated / {name}"
            if key not in done:
                cells = [clean_cell(psi, groups, setting) for psi, groups in feds]
                save(
                    key,
                    {
                        "ari": round(float(np.mean([c["ari"] for c in cells])), 4),
                        "ari_min": min(c["ari_min"] for c in cells),
                        "clusters": [k for c in cells for k in c["clusters"]],
                    },
                )
            for when in ("late", "early"):
                for k in COLLUDERS:
                    key = f"{prefix}attack {when} k={k} / {name}"
                    if key not in done:
                        t0 = time.perf_counter()
                        row = attack_cell(feds, setting, k, when == "early")
                        row["seconds"] = round(time.perf_counter() - t0, 1)
                        save(key, row)
    for scenario, (n, d) in CLEAN.items():
        todo = [name for name in SETTINGS if f"clean {scenario} {n}x{d} / {name}" not in done]
        if not todo:
            continue
        psi, groups = representations(args.data_dir, scenario, n, d, 0)
        for name in todo:
            t0 = time.perf_counter()
            row = clean_cell(psi, groups, SETTINGS[name])
            row["seconds"] = round(time.perf_counter() - t0, 1)
            save(f"clean {scenario} {n}x{d} / {name}", row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
