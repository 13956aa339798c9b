"""New and unseen clients on a finished run (StoCFL paper, section 4.4).

A new client sends Psi once; the server compares it with every cluster representation, the
client joins the most similar cluster when the cosine reaches tau, otherwise it would open a
new cluster; it is predicted with the closest cluster's model. Algorithms without clusters
predict with their global model.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from stocfl import config as config_mod
from stocfl.algorithms.checks import check_placements
from stocfl.client.mixture import evaluation_task
from stocfl.data.federation import Federation
from stocfl.errors import UserError, first_repeated
from stocfl.executors import make_executor
from stocfl.experiment import configure
from stocfl.experiment.build import build_federation, checked, read_config
from stocfl.experiment.loop import Experiment
from stocfl.experiment.results import placement_rows, summarize_placements
from stocfl.storage.files import exclusive

NEW_DATA_KEYS = ("scenario.", "run.seed")


def place_clients(
    run_dir: str | Path,
    overrides: list[str] = (),
    clients: list[int] | None = None,
    data_dir: str | None = None,
    unlabeled: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Place clients on the saved run in ``run_dir``.

    Without ``overrides`` the clients are the run's held-out clients (``scenario.holdout``);
    with ``overrides`` (``scenario.*`` keys or ``run.seed``) a new federation is built from the
    run's scenario so changed and all its clients (or ``clients``) are placed. ``unlabeled``:
    the clients hold no labels (:meth:`~stocfl.algorithms.Algorithm.place_unlabeled`; only
    for methods that can, FLUX). Returns one row per client and a summary."""
    out = Path(run_dir)
    with exclusive(out) if out.is_dir() else contextlib.nullcontext():  # no run writes while we read
        return _place(out, overrides, clients, data_dir, unlabeled)


def _place(out: Path, overrides, clients, data_dir, unlabeled) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    exp = Experiment.open(out, data_dir)
    if unlabeled and not exp.algorithm.places_unlabeled:
        from stocfl.algorithms import ALGORITHMS

        can = ", ".join(n for n, c in ALGORITHMS.items() if c.places_unlabeled)
        raise UserError(
            f"--unlabeled: {exp.algorithm.name} places a new client from its labels ({exp.algorithm.placement}); "
            f"without labels only {can} can place one"
        )
    fed, executor = exp.fed, exp.executor
    if overrides:
        bad = [o for o in overrides if not o.split("=", 1)[0].startswith(NEW_DATA_KEYS)]
        if bad:
            raise UserError(f"--set {bad[0]!r}: new clients may change only scenario.* keys and run.seed")
        raw = read_config(out, data_dir)
        for item in overrides:
            parts, value = config_mod.parse_override(item)
            raw.setdefault(parts[0], {})[parts[-1]] = value
        fed = build_federation(configure.validate(raw))
        if _same_train_data(fed, exp.fed):
            raise UserError(
                f"--set {' '.join(overrides)} builds the run's own clients (the same train data), which it "
                f"trained on; change run.seed or how the scenario splits the data (without --set, the "
                f"run's held-out clients are placed)"
            )
        if fed.input_shape != exp.fed.input_shape or fed.n_classes != exp.fed.n_classes:
            raise UserError(
                f"the new clients' data ({fed.input_shape}, {fed.n_classes} classes) does not fit the "
                f"run's model ({exp.fed.input_shape}, {exp.fed.n_classes} classes)"
            )
        executor = make_executor(exp.engine, fed, exp.model, exp.cfg)
        chosen = clients if clients is not None else list(range(fed.n_clients))
    else:
        held = fed.heldout_clients
        held_set = set(held)
        if not held:
            raise UserError(
                f"{out} has no held-out clients (scenario.holdout = {exp.cfg.scenario.holdout}); pass new "
                "clients' data with --set scenario.KEY=VALUE or --set run.seed=N"
            )
        chosen = clients if clients is not None else held
        trained = [i for i in chosen if 0 <= i < fed.n_clients and i not in held_set]
        if trained:
            raise UserError(
                f"client {trained[0]} took part in training, so it is not new; choose among the held-out "
                f"clients {_ids(held)}, or pass new clients' data with --set"
            )
    bad_ids = [i for i in chosen if not 0 <= i < fed.n_clients]
    if bad_ids:
        raise UserError(f"client {bad_ids[0]} does not exist; the federation has clients 0..{fed.n_clients - 1}")
    if (k := first_repeated(chosen)) is not None:
        raise UserError(f"client {chosen[k]} is given twice; give each client once (each counts once in the accuracy)")
    ask = checked(executor.execute, fed)
    alg = exp.algorithm
    placed = (alg.place_unlabeled if unlabeled else alg.place_new)(list(chosen), ask)
    check_placements(alg, list(chosen), placed)
    results = ask([evaluation_task(p.client, p.weights) for p in placed])
    rows = placement_rows(placed, results, fed.groups, alg)
    return rows, summarize_placements(rows, alg.placement_unlabeled if unlabeled else alg.placement)


def _ids(ids: list[int], shown: int = 10) -> str:
    return ",".join(map(str, ids[:shown])) + (f",... ({len(ids)} in all)" if len(ids) > shown else "")


def _same_train_data(a: Federation, b: Federation) -> bool:
    return (
        a.x_train.shape == b.x_train.shape
        and torch.equal(torch.as_tensor(a.train_offsets), torch.as_tensor(b.train_offsets))
        and torch.equal(torch.as_tensor(a.y_train), torch.as_tensor(b.y_train))
        and torch.equal(torch.as_tensor(a.x_train), torch.as_tensor(b.x_train))
    )
