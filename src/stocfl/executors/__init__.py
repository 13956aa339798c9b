"""Executors run lists of client tasks. Algorithms never know which one runs them."""

from __future__ import annotations

import os

import torch

from stocfl.errors import UserError
from stocfl.executors.base import Executor
from stocfl.executors.batched import BatchedExecutor
from stocfl.executors.sequential import SequentialExecutor

ENGINES = ("auto", "sequential", "batched")

# Per-step work per client (about 6 * P * B flops) below which per-client overhead dominates
# and batching clients with vmap pays; measured by `stocfl bench` (see README).
BATCHED_BELOW_FLOPS = 5e7


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def set_threads(threads: int = 0) -> int:
    """Use ``threads`` torch threads (0 = the cores this process may run on); oversubscribing
    the cores made a prototype 7-9x slower. Kept fixed for a run so numbers repeat."""
    cores = usable_cores()
    if threads > cores:
        raise UserError(f"config: run.threads = {threads} is more than the {cores} cores this process may use; "
                        f"use at most {cores} (0 = all of them)")
    n = threads or cores
    torch.set_num_threads(n)
    return n


def choose_engine(engine: str, n_params: int, batch_size: int, mean_client_size: float) -> str:
    if engine != "auto":
        return engine
    b = mean_client_size if batch_size == 0 else min(batch_size, mean_client_size)
    return "batched" if 6.0 * n_params * b < BATCHED_BELOW_FLOPS else "sequential"


def make_executor(engine: str, federation, model, chunk_size: int = 0) -> Executor:
    if engine == "sequential":
        return SequentialExecutor(federation, model)
    if engine == "batched":
        return BatchedExecutor(federation, model, chunk_size=chunk_size)
    raise UserError(f"run.engine = {engine!r} is not an in-process executor; choose one of {', '.join(ENGINES)}")


__all__ = ["Executor", "SequentialExecutor", "BatchedExecutor", "make_executor", "choose_engine", "set_threads"]
