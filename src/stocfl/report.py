"""Results on disk: metrics.jsonl, summary.json, the resolved config as TOML, PNG plots."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stocfl.files import save_figure, write_atomic


def clustering_scores(labels: np.ndarray, groups: np.ndarray | None, participants: list[int] | None = None
                      ) -> dict[str, Any]:
    """Over the participants placed so far (held-out clients never count): their number
    (``placed``), the number of clusters among them, ARI and NMI against the true groups."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    assigned = labels >= 0
    if participants is not None:
        assigned &= np.isin(np.arange(len(labels)), participants)
    out: dict[str, Any] = {"n_clusters": int(len(np.unique(labels[assigned]))), "placed": int(assigned.sum()),
                           "ari": None, "nmi": None}
    if groups is not None and assigned.any():
        out["ari"] = float(adjusted_rand_score(groups[assigned], labels[assigned]))
        out["nmi"] = float(normalized_mutual_info_score(groups[assigned], labels[assigned]))
    return out


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


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv
    import io

    buf = io.StringIO(newline="")
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    write_atomic(path, buf.getvalue())


def cluster_table(labels: np.ndarray, groups: np.ndarray | None, evals: dict) -> list[dict[str, Any]]:
    """Per found cluster: members, the mix of true groups, accuracy of its members (own model)."""
    rows = []
    for k in np.unique(labels[labels >= 0]):
        members = np.flatnonzero(labels == k)
        res = [evals[i] for i in members if i in evals]
        n = sum(r.n_samples for r in res)
        row = {"cluster": int(k), "members": len(members),
               "accuracy": sum(r.correct for r in res) / n if n else None}
        if groups is not None:
            mix = np.bincount(groups[members], minlength=int(groups.max()) + 1)
            row["true_groups"] = " ".join(f"{g}:{c}" for g, c in enumerate(mix) if c)
        rows.append(row)
    return rows


def plot_accuracy(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [r for r in rows if r.get("accuracy") is not None]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax.plot([r["round"] for r in ev], [r["accuracy"] for r in ev], label="clients (own model)")
    ax.plot([r["round"] for r in ev], [r["global_accuracy"] for r in ev], "--", label="global model")
    ax.set(xlabel="round", ylabel="test accuracy", title=title, ylim=(0, 1))
    ax.legend()
    ax.grid(alpha=0.3)
    ax2.plot([r["round"] for r in rows], [r["n_clusters"] for r in rows], color="C2", label="clusters")
    ax2.set(xlabel="round", ylabel="number of clusters")
    ax2.set_ylim(bottom=0, top=max([r["n_clusters"] for r in rows] + [1]) * 1.15 + 0.5)
    ax2.yaxis.get_major_locator().set_params(integer=True)
    if any(r.get("ari") is not None for r in rows):
        ax3 = ax2.twinx()
        ax3.plot([r["round"] for r in rows], [r["ari"] for r in rows], color="C3", label="ARI")
        ax3.set(ylabel="ARI", ylim=(-0.05, 1.05))
        ax3.legend(loc="lower right")
    ax2.legend(loc="upper left")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
