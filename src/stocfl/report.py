"""Results on disk: metrics.jsonl, summary.json, the resolved config as TOML, PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stocfl.files import save_figure, write_atomic


def clustering_scores(labels: np.ndarray, groups: np.ndarray | None, participants: list[int] | None = None,
                      label_dists: np.ndarray | None = None) -> dict[str, Any]:
    """Over the participants placed so far (held-out clients never count): their number
    (``placed``) and share of all participants (``coverage``), the number of clusters among
    them, ARI and NMI against the true groups, and with ``label_dists`` (the clients' unit
    label histograms) :func:`label_cosines`, which needs no true groups."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    assigned = labels >= 0
    if participants is not None:
        assigned &= np.isin(np.arange(len(labels)), participants)
    n = len(participants) if participants is not None else len(labels)
    out: dict[str, Any] = {"n_clusters": int(len(np.unique(labels[assigned]))), "placed": int(assigned.sum()),
                           "coverage": float(assigned.sum() / n) if n else None, "ari": None, "nmi": None}
    if groups is not None and assigned.any():
        out["ari"] = float(adjusted_rand_score(groups[assigned], labels[assigned]))
        out["nmi"] = float(normalized_mutual_info_score(groups[assigned], labels[assigned]))
    if label_dists is not None:
        out.update(label_cosines(label_dists[assigned], labels[assigned]))
    return out


def label_cosines(dists: np.ndarray, labels: np.ndarray) -> dict[str, float | None]:
    """How far a partition follows the clients' labels, with no true groups needed: the mean
    cosine between the label distributions (unit rows of ``dists``) of two clients in one
    cluster (``label_cos_within``) and of any two clients (``label_cos_all``); None where there
    is no such pair. A partition that ignores the labels has within = all. Computed from
    per-cluster sums (sum over pairs i != j of u_i.u_j = |sum u|^2 - sum |u|^2), O(N C), so
    it runs every round at any N."""
    n = len(labels)
    if n < 2:
        return {"label_cos_within": None, "label_cos_all": None}
    dists = np.asarray(dists, dtype=np.float64)
    self_dots = float(np.einsum("ij,ij->", dists, dists))
    total = dists.sum(axis=0)
    _, inverse, sizes = np.unique(labels, return_inverse=True, return_counts=True)
    sums = np.zeros((len(sizes), dists.shape[1]))
    np.add.at(sums, inverse, dists)
    pairs_within = float((sizes * (sizes - 1)).sum())
    within = (float(np.einsum("ij,ij->", sums, sums)) - self_dots) / pairs_within if pairs_within else None
    return {"label_cos_within": within, "label_cos_all": (float(total @ total) - self_dots) / (n * (n - 1))}


def json_line(row: dict[str, Any]) -> str:
    """One metrics row as written (and as the checkpoint's hash chain reads it)."""
    return json.dumps(row, sort_keys=True)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json_line(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: everything after it is redone
    return rows


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json_line(r) + "\n" for r in rows))


def to_toml(cfg: dict[str, dict[str, Any]]) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    return "\n".join(
        f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items()) for section, keys in cfg.items()
    )


CSV_DECIMALS = 6  # every float in every CSV file: one precision, enough for accuracies on 10^5 samples


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv
    import io

    buf = io.StringIO(newline="")
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: round(v, CSV_DECIMALS) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    write_atomic(path, buf.getvalue())


def cluster_numbers(labels: np.ndarray, ids=()) -> dict[int, int]:
    """Internal cluster id -> the number a reader sees: 0..K-1, clusters ordered by their
    lowest-numbered member, so that one partition is numbered alike whatever algorithm found it;
    then the ``ids`` that have no member (a model no client chose), in id order."""
    found, first = np.unique(labels[labels >= 0], return_index=True)
    first = np.flatnonzero(labels >= 0)[first]
    number = {int(found[j]): n for n, j in enumerate(np.argsort(first, kind="stable"))}
    for k in sorted(int(k) for k in ids if int(k) not in number):
        number[k] = len(number)
    return number


def cluster_table(labels: np.ndarray, groups: np.ndarray | None, evals: dict) -> list[dict[str, Any]]:
    """Per found cluster (numbered by :func:`cluster_numbers`, the algorithm's own id beside):
    members, the mix of true groups as ``group:count`` pairs, accuracy of its members (own model)."""
    rows = []
    for k, number in sorted(cluster_numbers(labels).items(), key=lambda kv: kv[1]):
        members = np.flatnonzero(labels == k)
        res = [evals[i] for i in members if i in evals]
        n = sum(r.n_samples for r in res)
        row = {"cluster": number, "id": k, "members": len(members),
               "accuracy": sum(r.correct for r in res) / n if n else None}
        if groups is not None:
            mix = np.bincount(groups[members], minlength=int(groups.max()) + 1)
            row["true_groups"] = " ".join(f"{g}:{c}" for g, c in enumerate(mix) if c)
        rows.append(row)
    return rows


def integer_rounds(ax) -> None:
    """Whole-number round ticks, however short the run."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_accuracy(rows: list[dict[str, Any]], path: Path, title: str, true_k: int | None = None) -> None:
    """Left: accuracy per evaluated round (own model, global model). Right: clusters found per
    round against the true number (``true_k``, where the scenario has one), and on a second
    axis ARI and the share of participants placed so far (what ARI is computed over)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [r for r in rows if r.get("accuracy") is not None]
    mark = "o" if len(ev) <= 30 else None
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.4))
    ax.plot([r["round"] for r in ev], [r["accuracy"] for r in ev], marker=mark, ms=3, label="clients (own model)")
    ax.plot([r["round"] for r in ev], [r["global_accuracy"] for r in ev], "--", marker=mark, ms=3,
            label="global model")
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    ax.grid(alpha=0.3)
    rounds = [r["round"] for r in rows]
    mark = "o" if len(rows) <= 30 else None
    handles = ax2.plot(rounds, [r["n_clusters"] for r in rows], color="C2", marker=mark, ms=3, label="clusters found")
    if true_k is not None:
        handles.append(ax2.axhline(true_k, color="C2", ls=":", lw=1.2, label=f"true K = {true_k}"))
    ax2.set(xlabel="round", ylabel="number of clusters", title="clustering")
    ax2.set_ylim(bottom=0, top=max([r["n_clusters"] for r in rows] + [true_k or 1]) * 1.15 + 0.5)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    ax3 = ax2.twinx()
    if any(r.get("ari") is not None for r in rows):
        handles += ax3.plot(rounds, [r["ari"] for r in rows], color="C3", marker=mark, ms=3, label="ARI")
    if any(r.get("coverage") is not None for r in rows):
        handles += ax3.plot(rounds, [r["coverage"] for r in rows], color="0.5", ls="--", lw=1,
                            label="share of clients placed")
    ax3.set(ylabel="ARI, share placed", ylim=(-0.05, 1.05))
    ax2.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(handles), frameon=False,
               fontsize=8)
    for a in (ax, ax2):
        integer_rounds(a)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
