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
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    im = ax.imshow(sims, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    if groups is not None:
        for b in np.flatnonzero(np.diff(groups[order])) + 0.5:
            ax.axhline(b, color="w", lw=0.6)
            ax.axvline(b, color="w", lw=0.6)
    ax.set(title=title, xlabel="client (by true group)", ylabel="client (by true group)")
    fig.colorbar(im, ax=ax, label="cosine")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def embedding(reps: torch.Tensor, labels: np.ndarray, groups: np.ndarray | None, path: Path, title: str,
              seed: int = 0) -> None:
    """2-D t-SNE (PCA for fewer than 10 clients) of representations, colored by found cluster,
    marker by true group (paper Fig. 3)."""
    plt = _plt()
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
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    markers = "os^Dv<>pP*X"
    _, color = np.unique(labels, return_inverse=True)
    for g in (np.unique(groups) if groups is not None else [None]):
        sel = np.ones(len(x), bool) if g is None else groups == g
        ax.scatter(xy[sel, 0], xy[sel, 1], c=color[sel], cmap="tab20", vmin=0, vmax=max(19, color.max()), s=14,
                   marker=markers[0 if g is None else int(g) % len(markers)],
                   label=None if g is None else f"group {g}")
    ax.set(title=f"{title} ({how}; color = found cluster)", xticks=[], yticks=[])
    if groups is not None:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
