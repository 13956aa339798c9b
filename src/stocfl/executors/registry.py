"""The engines by name (``run.engine``): the registry, ``auto``'s cost model, torch threads."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stocfl.client.training import LocalTraining
from stocfl.devices import resolve_device
from stocfl.errors import UserError, refuse_builtin
from stocfl.executors.base import Executor
from stocfl.executors.batched import BatchedExecutor
from stocfl.executors.lowrank import flops, structure
from stocfl.executors.parallel import ParallelExecutor
from stocfl.executors.sequential import SequentialExecutor

# Per-step work per client (about 6 * P * B flops) below which per-client overhead dominates
# and batching clients with vmap pays; `stocfl-lab bench` measures where (docs: measured figures).
BATCHED_BELOW_FLOPS = 5e7


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_threads(threads: int = 0) -> int:
    """Use ``threads`` torch threads (0 = the cores this process may run on); oversubscribing
    the cores made a prototype 7-9x slower. Kept fixed for a run so numbers repeat."""
    cores = usable_cores()
    if threads > cores:
        raise UserError(
            f"config: run.threads = {threads} is more than the {cores} cores this process may use; "
            f"use at most {cores} (0 = all of them)"
        )
    n = threads or cores
    torch.set_num_threads(n)
    return n


def choose_engine(engine: str, n_params: int, batch_size: int, mean_client_size: float, padding: float = 1.0) -> str:
    """``engine``, or for ``auto`` on the CPU: batched where per-client overhead dominates and the
    stack's padding (:func:`padding_factor`) wastes at most MAX_PADDING times the work, else
    sequential. ``n_params``: the parameters a sample meets in a forward pass, a convolution's
    once per output pixel (:meth:`~stocfl.client.models.FlatModel.step_params`), so that
    6 x n_params x the batch is a step's work."""
    if engine != "auto":
        return engine
    b = mean_client_size if batch_size == 0 else min(batch_size, mean_client_size)
    small = 6.0 * n_params * b < BATCHED_BELOW_FLOPS
    return "batched" if small and padding <= MAX_PADDING else "sequential"


# A batched stack trains every client for as many steps as its largest client needs: where the
# round's clients differ much in size (a Dirichlet split, quantity skew, real writers), the
# padded work outgrows what batching saves in overhead.
MAX_PADDING = 2.0


def padding_factor(sizes, per_round: int, draws: int = 32) -> float:
    """The work of training a round's clients in one padded stack over their own work: the mean
    over ``draws`` draws of ``per_round`` clients of (clients x the largest size) / (their total
    size). Drawn from a generator of its own, so a run's draws do not change."""
    sizes = np.asarray(sizes, dtype=float)
    if len(sizes) == 0 or sizes.sum() == 0:
        return 1.0
    m = max(1, min(int(per_round), len(sizes)))
    rng = np.random.default_rng(0)
    ratios = []
    for _ in range(draws):
        pick = sizes[rng.choice(len(sizes), m, replace=False)]
        ratios.append(m * pick.max() / max(pick.sum(), 1.0))
    return float(np.mean(ratios))


@dataclass(frozen=True)
class Engine:
    """A way to run client tasks, by its ``run.engine`` name: an in-process executor
    (``executor(federation, model, cfg) -> Executor``, ``cfg`` the run's config), or one that
    runs the whole experiment itself (``launch``: the Flower simulation)."""

    name: str
    description: str
    executor: Callable[..., Executor] | None = None
    launch: Callable[..., Any] | None = None


ENGINES: dict[str, Engine] = {}
BUILTIN_ENGINES = ("auto", "sequential", "parallel", "batched", "lowrank", "flower-sim")


def register_engine(engine: Engine) -> Engine:
    """Make ``engine`` usable as ``run.engine = engine.name`` in this process."""
    if not isinstance(engine, Engine) or not engine.name.replace("-", "_").isidentifier():
        raise UserError(f"register_engine: expected an Engine with a name such as 'my-engine', got {engine!r}")
    if (engine.executor is None) == (engine.launch is None):
        raise UserError(f"register_engine: engine {engine.name!r} needs exactly one of executor and launch")
    refuse_builtin("register_engine", engine.name, engine.name in BUILTIN_ENGINES and engine.name in ENGINES)
    ENGINES[engine.name] = engine
    return engine


def engine_of(name: str) -> Engine:
    try:
        return ENGINES[name]
    except KeyError:
        raise UserError(f"config: run.engine = {name!r} is unknown; choose one of {', '.join(ENGINES)}") from None


def make_executor(engine: str, federation, model, cfg) -> Executor:
    """An in-process executor of ``engine`` for the run configured by ``cfg``; its ``name`` is
    the engine that runs (``auto`` resolves to one)."""
    e = engine_of(engine)
    if e.executor is None:
        raise UserError(
            f"run.engine = {engine!r} runs through 'stocfl run'/'stocfl resume', not in-process; choose "
            f"one of {', '.join(n for n, x in ENGINES.items() if x.executor is not None)}"
        )
    executor = e.executor(federation, model, cfg)
    if not callable(getattr(executor, "execute", None)):
        named = " (its run(tasks) is now execute(tasks))" if callable(getattr(executor, "run", None)) else ""
        raise UserError(
            f"run.engine = {engine!r} made a {type(executor).__name__}, which has no execute(tasks) method{named}; "
            f"an engine's executor returns one reply per task from execute(tasks)"
        )
    return executor


def choose_lowrank(model, epochs: int, batch_size: int, mean_client_size: float, plain_sgd: bool) -> bool:
    """The cost model of the low-rank path: take it when plain SGD on a dense first layer costs
    fewer multiply-adds that way (with a proximal center other than the start, the dearer case)."""
    s = structure(model)
    if s is None or not plain_sgd:
        return False
    plain, low = flops(s, max(1, round(mean_client_size)), epochs, batch_size, prox_distinct=True)
    return low < plain


def _auto(federation, model, cfg) -> Executor:
    """On the CPU: where per-step work is small, per-client overhead dominates and batching
    pays; where it is large (compute-bound), the path with less arithmetic wins: low-rank when
    it has less. On an accelerator, clients are always batched (low-rank when it has less).
    A model with dropout always runs client by client: the sequential loop, in parallel's
    workers where torch has more than one thread."""
    t, n = LocalTraining.from_config(cfg.train), float(federation.train_sizes.mean())
    on_cpu = resolve_device(cfg.run.device).type == "cpu"
    chosen = "batched"
    if on_cpu:
        sizes = federation.train_sizes
        padding = padding_factor(sizes, math.ceil(cfg.run.sample_rate * len(sizes)))
        chosen = choose_engine("auto", model.step_params(federation.input_shape), t.batch_size, n, padding)
    plain_sgd = t.optimizer.plain
    if (chosen == "sequential" or not on_cpu) and choose_lowrank(model, t.epochs, t.batch_size, n, plain_sgd):
        chosen = "lowrank"
    if model.random:  # dropout: each client's draws as it trains alone, only the sequential loop has them
        chosen = "sequential"
    if chosen == "sequential" and on_cpu and torch.get_num_threads() > 1 and sys.platform == "linux":
        chosen = "parallel"  # whole clients side by side, one thread each, beat one client on every thread
    return make_executor(chosen, federation, model, cfg)


register_engine(
    Engine(
        "auto", "lowrank, sequential or batched, chosen by a cost model of the model, data and training", executor=_auto
    )
)
register_engine(
    Engine(
        "sequential",
        "one client after another, a tight loop over pre-stacked tensors",
        executor=lambda fed, model, cfg: SequentialExecutor(fed, model, resolve_device(cfg.run.device)),
    )
)
register_engine(
    Engine(
        "parallel",
        "the sequential loop in worker processes, one per torch thread, each on one thread (CPU)",
        executor=lambda fed, model, cfg: ParallelExecutor(
            fed, model, workers=torch.get_num_threads(), device=resolve_device(cfg.run.device)
        ),
    )
)
register_engine(
    Engine(
        "batched",
        "chunks of clients as one vmap(grad) computation",
        executor=lambda fed, model, cfg: BatchedExecutor(
            fed, model, chunk_size=cfg.run.chunk_size, device=resolve_device(cfg.run.device)
        ),
    )
)
register_engine(
    Engine(
        "lowrank",
        "batched, with plain-SGD training of a dense first layer in the span of each "
        "client's inputs (exact; stocfl.executors.lowrank)",
        executor=lambda fed, model, cfg: BatchedExecutor(
            fed,
            model,
            chunk_size=cfg.run.chunk_size,
            lowrank=True,
            device=resolve_device(cfg.run.device),
            factored=cfg.run.factored_replies,
        ),
    )
)
