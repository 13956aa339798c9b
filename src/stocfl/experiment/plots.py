"""The figures of a results directory: accuracy and clustering per round (accuracy.png); the
client representations' cosine matrix and t-SNE embedding (StoCFL paper, Figures 2 and 3)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from stocfl.storage.files import save_figure


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def similarity_matrix(reps: torch.Tensor, groups: np.ndarray | None, path: Path, title: str) -> None:
    """Cosine similarities of client representations, ordered by true group (paper Fig. 2)."""
    plt = _plt()
    u = reps.double()
    u = u / u.norm(dim=1, keepdim=True).clamp(min=1e-12)
    order = np.argsort(groups, kind="stable") if groups is not None else np.arange(len(u))
    sims = (u[order] @ u[order].T).numpy()
    fig, ax = plt.subplots(figsize=(6.0, 5.2))
    im = ax.imshow(sims, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    if groups is not None:
        edges = np.flatnonzero(np.diff(groups[order])) + 0.5
        for b in edges:
            ax.axhline(b, color="w", lw=0.6)
            ax.axvline(b, color="w", lw=0.6)
        bounds = np.concatenate([[-0.5], edges, [len(u) - 0.5]])
        names = np.unique(groups)
        if len(names) <= 20:  # one tick per true group, at the middle of its block
            mids = (bounds[:-1] + bounds[1:]) / 2
            ax.set_xticks(mids, [str(g) for g in names])
            ax.set_yticks(mids, [str(g) for g in names])
        ax.set(xlabel="clients, by true group", ylabel="clients, by true group")
    else:
        ax.set(xlabel="client", ylabel="client")
    ax.set_title(title.replace(", ", "\n", 1), fontsize=10)
    fig.colorbar(im, ax=ax, label="cosine")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def embedding(
    reps: torch.Tensor, clusters: np.ndarray, groups: np.ndarray | None, path: Path, title: str, seed: int = 0
) -> None:
    """2-D t-SNE (PCA for fewer than 10 clients) of representations (paper Fig. 3): colour =
    found cluster (``clusters``: numbered as in clusters.csv), marker = true group."""
    plt = _plt()
    from matplotlib.lines import Line2D

    x = reps.double().numpy()
    x = np.pad(x, ((0, 0), (0, max(0, 2 - x.shape[1]))))  # 1-dimensional (sketched) representations
    if len(x) >= 10:
        from sklearn.manifold import TSNE

        xy = TSNE(2, perplexity=min(30.0, (len(x) - 1) / 3), init="pca", random_state=seed).fit_transform(x)
        how = "t-SNE"
    else:
        from sklearn.decomposition import PCA

        xy = PCA(min(2, len(x))).fit_transform(x) if len(x) > 1 else np.zeros((len(x), 2))
        xy = np.pad(xy, ((0, 0), (0, 2 - xy.shape[1])))
        how = "PCA"
    found = np.unique(clusters)
    palette = plt.get_cmap("tab10" if len(found) <= 10 else "tab20").colors
    colour = {k: palette[n % len(palette)] for n, k in enumerate(found)}
    fig, ax = plt.subplots(figsize=(7.4, 5.0))
    markers = "o^sDvP*X<>p"
    for g in np.unique(groups) if groups is not None else [None]:
        sel = np.ones(len(x), bool) if g is None else groups == g
        ax.scatter(
            xy[sel, 0],
            xy[sel, 1],
            c=[colour[k] for k in clusters[sel]],
            s=22,
            alpha=0.85,
            edgecolors="k",
            linewidths=0.3,
            marker=markers[0 if g is None else int(g) % len(markers)],
        )
    ax.set(title=f"{title}\n{how} of client representations", xticks=[], yticks=[])
    shown = found[:20]
    cl = [Line2D([], [], ls="", marker="o", ms=7, mfc=colour[k], mec="k", mew=0.3, label=f"{k}") for k in shown]
    if len(found) > len(shown):
        cl.append(Line2D([], [], ls="", label=f"+{len(found) - len(shown)} more"))
    first = ax.legend(
        handles=cl,
        title="colour: found cluster",
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        fontsize=7,
        title_fontsize=8,
        ncol=1 + len(shown) // 11,
    )
    if groups is not None:
        ax.add_artist(first)
        gs = np.unique(groups)
        mk = [
            Line2D([], [], ls="", marker=markers[int(g) % len(markers)], ms=7, mfc="none", mec="k", label=f"{g}")
            for g in gs[:20]
        ]
        ax.legend(
            handles=mk,
            title="marker: true group",
            loc="lower left",
            bbox_to_anchor=(1.01, 0.0),
            fontsize=7,
            title_fontsize=8,
            ncol=1 + len(mk) // 11,
        )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


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
    ax.plot([r["round"] for r in ev], [r["global_accuracy"] for r in ev], "--", marker=mark, ms=3, label="global model")
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
        handles += ax3.plot(
            rounds, [r["coverage"] for r in rows], color="0.5", ls="--", lw=1, label="share of clients placed"
        )
    ax3.set(ylabel="ARI, share placed", ylim=(-0.05, 1.05))
    ax2.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=len(handles), frameon=False, fontsize=8
    )
    for a in (ax, ax2):
        integer_rounds(a)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
