"""Executors run lists of client tasks; algorithms never know which one runs them. The engines
(``run.engine`` names) and ``auto``'s choice among them are in :mod:`stocfl.executors.registry`."""

from stocfl.executors.base import Executor
from stocfl.executors.batched import BatchedExecutor
from stocfl.executors.drifting import Drifting
from stocfl.executors.lowrank import Structure, structure
from stocfl.executors.lowrank import flops as lowrank_flops
from stocfl.executors.parallel import ParallelExecutor
from stocfl.executors.pool import trim_freed_memory
from stocfl.executors.registry import (
    BATCHED_BELOW_FLOPS,
    BUILTIN_ENGINES,
    ENGINES,
    Engine,
    choose_engine,
    choose_lowrank,
    engine_of,
    make_executor,
    register_engine,
    set_threads,
    usable_cores,
)
from stocfl.executors.sequential import SequentialExecutor

__all__ = [
    "lowrank_flops",
    "BATCHED_BELOW_FLOPS",
    "BUILTIN_ENGINES",
    "ENGINES",
    "BatchedExecutor",
    "Drifting",
    "Engine",
    "Executor",
    "ParallelExecutor",
    "SequentialExecutor",
    "Structure",
    "choose_engine",
    "choose_lowrank",
    "engine_of",
    "make_executor",
    "register_engine",
    "set_threads",
    "structure",
    "trim_freed_memory",
    "usable_cores",
]
