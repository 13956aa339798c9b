"""How FL+HC's default distance thresholds were chosen (``stocfl.algorithms.flhc``).

Runs FL+HC's warm-up (FedAvg) on a setting, then its clustering step (every participant
trains the global model for ``cluster_epochs`` epochs), and prints, per metric and linkage,
the dendrogram heights of the clustering step's updates: the highest merge inside a true
group and the lowest merge across groups, and how many clusters each candidate threshold
gives. Results go to ``benchmarks/flhc_threshold.json``.

    python benchmarks/flhc_threshold.py --data-dir ../shared/data            # the paper's setting
    python benchmarks/flhc_threshold.py --setting digits                     # the embedded default
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from scipy.cluster.hierarchy import fcluster, linkage

from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

SETTINGS = {
    # Briggs et al. section II-A/III: 100 clients x 600 MNIST images, label swap, their CNN,
    # B = 10, E = 3, lr 0.1, cf = 0.2, clustering after n = 10 rounds
    "paper_label_swap": [
        "scenario.name=label_swap",
        "scenario.dataset=mnist",
        "scenario.n_clients=100",
        "scenario.samples_per_client=600",
        "model.name=cnn28",
        "train.epochs=3",
        "train.batch_size=10",
        "train.lr=0.1",
        "run.sample_rate=0.2",
    ],
    "digits": [
        "scenario.name=label_swap",
        "scenario.dataset=digits",
        "scenario.n_clients=40",
        "scenario.samples_per_client=30",
        "train.epochs=3",
        "train.batch_size=10",
        "train.lr=0.1",
        "run.sample_rate=0.2",
    ],
}
CUTS = {
    "l1": ["complete", "average", "single"],
    "l2": ["ward", "complete", "average", "single"],
    "cosine": ["complete", "average", "single"],
}
SCIPY_METRIC = {"l1": "cityblock", "l2": "euclidean", "cosine": "cosine"}


def updates(overrides: list[str], data_dir: str | None, warmup: int, cluster_epochs: int):
    cfg = configure.load(overrides=[*overrides, "algorithm.name=fedavg", f"run.rounds={warmup}"], data_dir=data_dir)
    with tempfile.TemporaryDirectory() as tmp:
        exp = Experiment.create(cfg, Path(tmp) / "warmup")
        exp.run(progress=False)
        w = exp.algorithm.global_model()
        clients = exp.algorithm.ctx.training_clients
        step = warmup + 1  # FL+HC's clustering step, as flhc.FLHC.cluster asks it
        res = exp.executor.execute([exp.algorithm.local_training(step, i, w, epochs=cluster_epochs) for i in clients])
    return torch.stack([r.weights - w for r in res]).double().numpy(), exp.fed.groups[clients], int(w.numel())


def study(dw: np.ndarray, groups: np.ndarray) -> dict:
    out = {}
    k_true = len(np.unique(groups))
    for metric, linkages in CUTS.items():
        for method in linkages:
            z = linkage(dw, method=method, metric=SCIPY_METRIC[metric])
            heights = z[:, 2]
            # the highest merge that stays inside one true group, the lowest that crosses groups
            members = [[i] for i in range(len(dw))]
            inside, across = [], []
            for a, b, h, _ in z:
                ga, gb = {groups[i] for i in members[int(a)]}, {groups[i] for i in members[int(b)]}
                (inside if len(ga | gb) == 1 else across).append(float(h))
                members.append(members[int(a)] + members[int(b)])
            gap = (max(inside) if inside else 0.0, min(across) if across else float("inf"))
            out[f"{metric}/{method}"] = {
                "highest_within_group": gap[0],
                "lowest_across_groups": gap[1],
                "separable": gap[0] < gap[1],
                "top_heights": [round(float(x), 6) for x in sorted(heights)[-(k_true + 3) :]],
                "median_height": float(np.median(heights)),
            }
    return out


def clusters_at(dw: np.ndarray, metric: str, method: str, threshold: float) -> int:
    z = linkage(dw, method=method, metric=SCIPY_METRIC[metric])
    return int(fcluster(z, t=threshold, criterion="distance").max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", default="paper_label_swap", choices=sorted(SETTINGS))
    ap.add_argument("--data-dir")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cluster-epochs", type=int, default=3)
    ap.add_argument("--thresholds", default="", help="metric/linkage=value,... to count clusters at")
    ap.add_argument("--out", default=str(Path(__file__).with_name("flhc_threshold.json")))
    args = ap.parse_args()
    t0 = time.perf_counter()
    dw, groups, n_params = updates(SETTINGS[args.setting], args.data_dir, args.warmup, args.cluster_epochs)
    res = {
        "setting": args.setting,
        "overrides": SETTINGS[args.setting],
        "warmup": args.warmup,
        "cluster_epochs": args.cluster_epochs,
        "clients": len(dw),
        "params": n_params,
        "mean_update_l2": float(np.linalg.norm(dw, axis=1).mean()),
        "mean_update_l1": float(np.abs(dw).sum(axis=1).mean()),
        "study": study(dw, groups),
    }
    for item in filter(None, args.thresholds.split(",")):
        key, value = item.split("=")
        metric, method = key.split("/")
        res.setdefault("clusters_at", {})[item] = clusters_at(dw, metric, method, float(value))
    res["seconds"] = round(time.perf_counter() - t0, 1)
    path = Path(args.out)
    allres = json.loads(path.read_text()) if path.exists() else {}
    allres[args.setting] = res
    path.write_text(json.dumps(allres, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
