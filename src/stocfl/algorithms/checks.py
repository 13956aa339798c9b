"""What an algorithm (a built-in one or a user's) hands back, checked before the runner, the
results writer or ``stocfl assign`` makes a figure of it. Each fault is one UserError naming
the method, where it would otherwise print a wrong number or stop with a traceback."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stocfl.algorithms.base import Placement
from stocfl.client.mixture import MIXTURE_TOLERANCE, Mixture
from stocfl.errors import UserError
from stocfl.storage import formats


def _weights_problem(w: Any, like: torch.Tensor) -> str | None:
    if not isinstance(w, torch.Tensor):
        return f"a value of type {type(w).__name__}"
    if w.shape != like.shape or w.dtype != like.dtype:
        return f"a {w.dtype} tensor of shape {tuple(w.shape)}"
    return None


def _model_problem(m: Any, like: torch.Tensor) -> str | None:
    """A client's model: flat weights like w_0, or a :class:`Mixture` of K such models with
    weights on the simplex."""
    if not isinstance(m, Mixture):
        return _weights_problem(m, like)
    if not isinstance(m.models, torch.Tensor) or m.models.dim() != 2 or m.models.shape[1:] != like.shape:
        return f"a Mixture whose models have shape {tuple(getattr(m.models, 'shape', ()))}, not (K, {like.numel()})"
    k = len(m.models)
    w = m.weights
    if not isinstance(w, torch.Tensor) or w.shape != (k,) or not bool(torch.isfinite(w).all()):
        return f"a Mixture whose weights are not {k} finite numbers"
    if float(w.min()) < 0 or abs(float(w.sum()) - 1.0) > MIXTURE_TOLERANCE:
        return f"a Mixture whose weights {w.tolist()} are not a distribution"
    return None


def _expected(like: torch.Tensor) -> str:
    return f"expected a {like.dtype} tensor of shape {tuple(like.shape)}, the flat weights (as ctx.init_weights)"


def _expected_model(like: torch.Tensor) -> str:
    return _expected(like) + ", or a stocfl.client.mixture.Mixture of such models"


def check_outputs(algorithm) -> None:
    """What an algorithm (a user's too) hands the runner for an evaluation, checked before any
    figure is made from it: the global and cluster models are flat weights like w_0, the
    labels one integer per client."""
    name, like = algorithm.name, algorithm.ctx.init_weights
    if (bad := _weights_problem(algorithm.global_model(), like)) is not None:
        raise UserError(f"algorithm {name!r}: global_model() returned {bad}; {_expected(like)}")
    models = algorithm.cluster_models()
    if not isinstance(models, dict):
        raise UserError(
            f"algorithm {name!r}: cluster_models() returned a value of type {type(models).__name__}; "
            f"expected a dict cluster id -> weights"
        )
    for k, w in models.items():
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 0:
            raise UserError(f"algorithm {name!r}: cluster_models() has key {k!r}; expected cluster ids >= 0")
        if (bad := _weights_problem(w, like)) is not None:
            raise UserError(f"algorithm {name!r}: cluster_models()[{k}] is {bad}; {_expected(like)}")
    check_labels(algorithm)


def check_labels(algorithm) -> np.ndarray:
    """``cluster_labels()``: a numpy integer array of N, each a cluster id or -1; returned."""
    labels, n = algorithm.cluster_labels(), algorithm.ctx.n_clients
    if (
        not isinstance(labels, np.ndarray)
        or labels.shape != (n,)
        or not np.issubdtype(labels.dtype, np.integer)
        or (labels < -1).any()
    ):
        what = (
            f"an array of {labels.dtype} of shape {labels.shape}"
            if isinstance(labels, np.ndarray)
            else f"a value of type {type(labels).__name__}"
        )
        raise UserError(
            f"algorithm {algorithm.name!r}: cluster_labels() returned {what}; expected a numpy integer "
            f"array of shape ({n},): each client's cluster id, -1 for not placed"
        )
    return labels


def check_assignments(algorithm, labels: np.ndarray) -> np.ndarray | None:
    """``assignments()``: None, or (N, K) floats whose rows of placed clients (``labels`` >= 0)
    are distributions; returned."""
    w, n = algorithm.assignments(), algorithm.ctx.n_clients
    if w is None:
        return None
    placed = labels >= 0
    ok = isinstance(w, np.ndarray) and w.ndim == 2 and len(w) == n and np.issubdtype(w.dtype, np.floating)
    if ok and placed.any():
        rows = w[placed]
        sums = rows.sum(1) if np.isfinite(rows).all() else np.full(len(rows), np.nan)
        ok = bool((rows >= 0).all() and np.allclose(sums, 1.0, atol=MIXTURE_TOLERANCE))
    if not ok:
        what = f"an array of shape {w.shape}" if isinstance(w, np.ndarray) else f"a value of type {type(w).__name__}"
        raise UserError(
            f"algorithm {algorithm.name!r}: assignments() returned {what}; expected None or ({n}, K) floats whose "
            f"rows of placed clients are distributions"
        )
    return w


def check_client_models(algorithm, clients: list[int], models: Any) -> None:
    """``client_models(clients)``: one model like w_0 per client asked."""
    like = algorithm.ctx.init_weights
    if not isinstance(models, (list, tuple)) or len(models) != len(clients):
        got = f"{len(models)} models" if isinstance(models, (list, tuple)) else f"a {type(models).__name__}"
        raise UserError(
            f"algorithm {algorithm.name!r}: client_models() returned {got} for {len(clients)} clients; "
            f"expected a list of one model per client"
        )
    for i, w in zip(clients, models):
        if (bad := _model_problem(w, like)) is not None:
            raise UserError(
                f"algorithm {algorithm.name!r}: client_models() gave client {i} {bad}; {_expected_model(like)}"
            )


def check_diagnostics(algorithm, t: int, diag: Any, measured: dict[str, Any]) -> None:
    """A round's diagnostics go into metrics.jsonl beside the runner's figures: they may not
    replace one (a user's "accuracy" would be reported as the run's) and must be JSON."""
    name = algorithm.name
    if not isinstance(diag, dict) or not all(isinstance(k, str) for k in diag):
        raise UserError(
            f"algorithm {name!r}: round({t}) returned a value of type {type(diag).__name__}; expected a "
            f"dict of diagnostics with string keys ({{}} for none)"
        )
    if clash := sorted(set(diag) & (set(measured) | {"seconds"})):
        raise UserError(
            f"algorithm {name!r}: round({t}) returned {clash[0]!r}, a figure the runner measures "
            f"itself; give the algorithm's own figure another name"
        )
    try:
        formats.json_line(diag)
    except (TypeError, ValueError) as err:
        raise UserError(
            f"algorithm {name!r}: round({t}) returned diagnostics that are not JSON ({err}); return "
            f"numbers, strings, lists and dicts (a numpy array: .tolist())"
        ) from None


def check_placements(algorithm, clients: list[int], placed: Any) -> None:
    """``place_new(clients)``: one Placement per client, in order, with a model like w_0."""
    name, like = algorithm.name, algorithm.ctx.init_weights
    if not isinstance(placed, (list, tuple)) or [getattr(p, "client", None) for p in placed] != list(clients):
        raise UserError(
            f"algorithm {name!r}: place_new() must return one Placement per client asked, in the order "
            f"asked ({len(clients)} clients)"
        )
    for p in placed:
        if not isinstance(p, Placement):
            raise UserError(f"algorithm {name!r}: place_new() returned a {type(p).__name__}; expected Placement")
        if (bad := _model_problem(p.weights, like)) is not None:
            raise UserError(f"algorithm {name!r}: place_new() gave client {p.client} {bad}; {_expected_model(like)}")
