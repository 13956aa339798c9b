"""Figures of the client representations (StoCFL paper, Figures 2 and 3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stocfl.files import save_figure


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


def embedding(reps: torch.Tensor, clusters: np.ndarray, groups: np.ndarray | None, path: Path, title: str,
              seed: int = 0) -> None:
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
    for g in (np.unique(groups) if groups is not None else [None]):
        sel = np.ones(len(x), bool) if g is None else groups == g
        ax.scatter(xy[sel, 0], xy[sel, 1], c=[colour[k] for k in clusters[sel]], s=22, alpha=0.85,
                   edgecolors="k", linewidths=0.3, marker=markers[0 if g is None else int(g) % len(markers)])
    ax.set(title=f"{title}\n{how} of client representations", xticks=[], yticks=[])
    shown = found[:20]
    cl = [Line2D([], [], ls="", marker="o", ms=7, mfc=colour[k], mec="k", mew=0.3, label=f"{k}") for k in shown]
    if len(found) > len(shown):
        cl.append(Line2D([], [], ls="", label=f"+{len(found) - len(shown)} more"))
    first = ax.legend(handles=cl, title="colour: found cluster", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      fontsize=7, title_fontsize=8, ncol=1 + len(shown) // 11)
    if groups is not None:
        ax.add_artist(first)
        gs = np.unique(groups)
        mk = [Line2D([], [], ls="", marker=markers[int(g) % len(markers)], ms=7, mfc="none", mec="k", label=f"{g}")
              for g in gs[:20]]
        ax.legend(handles=mk, title="marker: true group", loc="lower left", bbox_to_anchor=(1.01, 0.0), fontsize=7,
                  title_fontsize=8, ncol=1 + len(mk) // 11)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
