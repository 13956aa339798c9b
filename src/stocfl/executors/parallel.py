"""Clients side by side in worker processes, one torch thread each.

On a CPU a small client step uses a second thread poorly, and two one-thread processes side by
side get more steps a second than one process with two threads (the figures are on the docs'
measured-figures page). Threads in one process do not get that (the interpreter lock
serialises the Python between the kernels), processes do.

Workers are forked from this process when the first tasks come, so they start with the
federation, the model and the registered task kinds. Tasks and results cross through shared
memory (torch.multiprocessing's tensor reductions). Each task runs its kind's reference
function in one worker on one thread, so its numbers are those of the sequential executor at
one torch thread, bit for bit, whichever worker takes it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import sys
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from stocfl.client.tasks import KINDS, kind_of
from stocfl.devices import map_tensors
from stocfl.errors import UserError
from stocfl.executors.base import Executor

_worker: ParallelExecutor | None = None  # the executor being forked; in a worker, the one it was forked from


def _start_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle (it names the run to resume)
    _die_with_parent()
    torch.set_num_threads(1)


def _die_with_parent() -> None:
    """Ask Linux to end this worker when the process that forked it dies. A parent killed
    (SIGTERM, SIGKILL, out of memory) otherwise leaves its workers waiting on a task queue whose
    write end they hold themselves, forever, or printing a traceback from a task half sent."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the request took hold
        os._exit(1)


def _run_part(tasks: list) -> list:
    assert _worker is not None
    return [_compact(r) for r in Executor.execute_reference(_worker, type(tasks[0]), tasks)]


def _compact(value: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """``value`` (a task or result dataclass) with each tensor field that is a view into a
    larger storage (a row of a stacked client store, a slice of the flat weights) replaced by a
    copy of its own: sending a view through shared memory would move its whole storage."""
    return map_tensors(value, _is_view, lambda v: v.clone(memory_format=torch.contiguous_format), memo)


def _is_view(v: torch.Tensor) -> bool:
    return (
        bool(v.storage_offset())
        or not v.is_contiguous()
        or v.untyped_storage().nbytes() != v.numel() * v.element_size()
    )


def part_sizes(n: int, workers: int) -> list[int]:
    """Guided scheduling: each part takes 1 / (2 x workers) of the tasks left, so parts shrink
    toward the end and the workers finish together. Equal parts of about n / (4 x workers)
    left one worker with 28 of 50 equal clients and the other with 22 (pfl's CIFAR CNN, 2
    workers: 2.46-2.64 s a round against 2.1 s for 25 clients in each of two processes)."""
    sizes = []
    while n > 0:
        sizes.append(max(1, -(-n // (2 * workers))))
        n -= sizes[-1]
    return sizes


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class ParallelExecutor(Executor):
    """The sequential executor's work spread over ``workers`` forked processes on the CPU."""

    name = "parallel"

    def __init__(self, federation, model, workers: int, device: str | torch.device = "cpu"):
        if torch.device(device).type != "cpu":
            raise UserError(
                f"run.engine = 'parallel' runs on the CPU, not on {torch.device(device)}; use batched or "
                f"sequential there, or set run.device = 'cpu'"
            )
        if not isinstance(workers, int) or workers < 1:
            raise UserError(f"parallel executor: workers must be a whole number >= 1, got {workers!r}")
        if workers > 1 and not fork_available():
            raise UserError(
                f"run.engine = 'parallel' forks worker processes, which {sys.platform} does not offer; "
                f"use run.engine = 'sequential'"
            )
        super().__init__(federation, model, device)
        self.workers = workers
        self._pool: ProcessPoolExecutor | None = None
        self._kinds: tuple = ()  # the task kinds registered when the workers were forked

    def execute_reference(self, kind: type, tasks: list) -> list:
        if self.workers == 1 or len(tasks) < 2:
            return super().execute_reference(kind, tasks)
        kind_of(kind)  # an unregistered kind is refused here, in one line
        memo: dict[int, torch.Tensor] = {}
        tasks = [_compact(t, memo) for t in tasks]
        ends = list(itertools.accumulate(part_sizes(len(tasks), self.workers)))
        parts = [tasks[a:b] for a, b in zip([0, *ends], ends)]
        try:
            return [r for part in self._workers().map(_run_part, parts) for r in part]
        except BrokenProcessPool:
            self.close()
            raise UserError(
                "parallel executor: a worker process died (killed for memory, by a signal, or /dev/shm was "
                "full); resume the run, with run.engine = 'sequential' if it happens again"
            ) from None
        except RuntimeError as e:
            if any(m in str(e) for m in ("shared memory", "No space left on device", "unable to write to file")):
                raise UserError(
                    f"parallel executor: cannot pass tensors through shared memory ({e}); enlarge "
                    f"/dev/shm or use run.engine = 'sequential'"
                ) from None
            raise

    def _workers(self) -> ProcessPoolExecutor:
        if self._pool is not None and self._kinds != tuple(KINDS.values()):  # a kind registered since the fork
            self.close()
        if self._pool is None:
            global _worker
            _worker = self
            try:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("fork"), initializer=_start_worker
                )
                # fork every worker now, while _worker names this executor for them to inherit
                list(self._pool.map(_noop, range(self.workers)))
            finally:
                _worker = None
            self._kinds = tuple(KINDS.values())
            self._finalizer = weakref.finalize(self, _shutdown, self._pool)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (a later run forks new ones)."""
        if self._pool is not None:
            self._finalizer.detach()
            _shutdown(self._pool)
            self._pool = None


def _noop(_: int) -> None:
    return None


def _shutdown(pool: ProcessPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["ParallelExecutor", "fork_available", "part_sizes"]
