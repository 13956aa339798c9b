"""Clients side by side in worker processes, one torch thread each.

On a CPU a small client step uses a second thread poorly, and two one-thread processes side by
side get more steps a second than one process with two threads (the figures are on the docs'
measured-figures page). Threads in one process do not get that (the interpreter lock
serialises the Python between the kernels), processes do.

Workers are forked from this process when the first tasks come, so they start with the
federation, the model and the registered task kinds. Tasks cross through shared memory
(torch.multiprocessing's tensor reductions); so do results, their large tensors through an
arena of shared memory each worker keeps from call to call (:class:`_Arena`). Each task runs
its kind's reference function in one worker on one thread, so its numbers are those of the
sequential executor at one torch thread, bit for bit, whichever worker takes it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import itertools
import multiprocessing
import os
import signal
import sys
import weakref
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from stocfl.client.tasks import KINDS, kind_of
from stocfl.devices import map_tensors
from stocfl.errors import UserError
from stocfl.executors.base import Executor

_worker: ParallelExecutor | None = None  # the executor being forked; in a worker, the one it was forked from


def _start_worker() -> None:
    global _arena
    assert _worker is not None
    _arena = _Arena(arena_cap(_worker.workers, _worker.arena_max))
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


def _run_part(job: tuple[int, bytes]) -> list:
    call, payload = job
    assert _worker is not None
    tasks = ForkingPickler.loads(payload)
    out = []
    for r in Executor.execute_reference(_worker, type(tasks[0]), tasks):
        placed: list[str] = []
        out.append((_outgoing(r, call, placed), placed))
    return out


class _Arena:
    """A worker's results, written into shared memory that the worker keeps from call to call.

    A result tensor sent as it is goes through a new shared-memory segment: the worker's pages
    are fresh (faulted and zeroed as it writes them), and so are the parent's as it first reads
    them, which cost several times the copy itself for model-sized replies. The arena's pages
    are written and mapped once; the parent copies each result out of it as it receives it
    (:func:`_incoming`), so a later call may write over them. What does not fit goes the plain
    way, and the arena grows to it for the next call, up to ``cap`` bytes."""

    def __init__(self, cap: int):
        self.cap, self.buf, self.call, self.used, self.wanted = cap, None, -1, 0, 0

    def put(self, t: torch.Tensor, call: int) -> torch.Tensor | None:
        """``t`` copied into the arena (a view of it), or None where it has no room."""
        if call != self.call:  # the parent has copied out every result of the calls before
            self.call, self.used = call, 0
            if self.wanted > (len(self.buf) if self.buf is not None else 0):
                self.buf = None  # the parent keeps its mapping until it has seen the new one
                try:
                    self.buf = torch.empty(self.wanted, dtype=torch.uint8).share_memory_()
                except RuntimeError:  # no room in /dev/shm: the plain way from now on
                    self.cap = 0
            self.wanted = 0
        start = -(-self.used // 64) * 64
        self.used = start + t.numel() * t.element_size()  # this call's results so far, fitting or not
        if self.buf is None or self.used > len(self.buf):
            self.wanted = min(self.cap, -(-self.used * 5 // 4 // ARENA_STEP) * ARENA_STEP)  # room to grow
            return None
        view = self.buf[start : self.used].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view


_arena: _Arena | None = None


def _outgoing(value: Any, call: int, placed: list[str]) -> Any:
    """A result on its way to the parent: its large tensors written into this worker's arena
    (their fields named in ``placed``), any other view replaced by a copy of its own
    (:func:`_compact`). Fields that hold one tensor still hold one tensor on arrival."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    changes: dict[str, torch.Tensor] = {}
    done: dict[int, tuple[torch.Tensor | None, bool]] = {}  # id -> (what is sent in its place, in the arena)
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
            continue
        if id(v) not in done:
            a = _arena.put(v, call) if _arena is not None and v.numel() * v.element_size() >= ARENA_FROM else None
            if a is not None:
                done[id(v)] = (a, True)
            elif _is_view(v):
                done[id(v)] = (v.clone(memory_format=torch.contiguous_format), False)
            else:
                done[id(v)] = (None, False)
        sent, in_arena = done[id(v)]
        if sent is not None:
            changes[f.name] = sent
        if in_arena:
            placed.append(f.name)
    return dataclasses.replace(value, **changes) if changes else value


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


ARENA_FROM = 1 << 16  # bytes of a result tensor from which it goes through the arena
ARENA_MAX = 1 << 30  # bytes of a worker's arena at most
ARENA_STEP = 1 << 24  # an arena grows by whole steps (it is not made anew for every few more bytes)


def arena_cap(workers: int, most: int = ARENA_MAX) -> int:
    """A worker's arena at most: ``most``, and a quarter of /dev/shm's free space shared by
    the workers (a call's results pass through it as they do without an arena)."""
    try:
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        return 0
    return max(0, min(most, free // (4 * workers)))


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
        self.arena_max = ARENA_MAX  # bytes of each worker's arena at most (taken when the workers fork)
        self._calls = 0  # calls to the workers: a worker's arena is written over from the next one on
        self._arenas: dict[int, torch.UntypedStorage] = {}

    def execute_reference(self, kind: type, tasks: list) -> list:
        if self.workers == 1 or len(tasks) < 2:
            return super().execute_reference(kind, tasks)
        kind_of(kind)  # an unregistered kind is refused here, in one line
        memo: dict[int, torch.Tensor] = {}
        tasks = [_compact(t, memo) for t in tasks]
        ends = list(itertools.accumulate(part_sizes(len(tasks), self.workers)))
        self._calls += 1
        # Pickled here, not by the pool's feeder thread: pickling moves each tensor into shared
        # memory, a copy that torch runs on a team of threads of the calling thread's own. A
        # second team in this process makes the OpenMP runtime stop spinning between parallel
        # regions (it counts more threads than cores), and every small multi-threaded operation
        # of the parent (the replies' checks, the mean) then waits on a woken thread for as
        # long as the feeder thread lives.
        parts = [(self._calls, bytes(ForkingPickler.dumps(tasks[a:b]))) for a, b in zip([0, *ends], ends)]
        seen: dict[int, torch.UntypedStorage] = {}
        try:
            out = [_incoming(r, placed, seen) for part in self._workers().map(_run_part, parts) for r, placed in part]
            if seen:  # the workers' arenas stay mapped here from call to call
                self._arenas = seen
            return out
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
            self._pool, self._arenas = None, {}


def _incoming(value: Any, placed: list[str], seen: dict[int, torch.UntypedStorage]) -> Any:
    """A result from a worker with its fields in the worker's arena copied out of it (the
    arena is written over by the worker's next call); the arena's storage noted in ``seen``."""
    if not placed:
        return value
    changes: dict[str, torch.Tensor] = {}
    copies: dict[tuple[int, int], torch.Tensor] = {}  # fields that were one tensor stay one
    for name in placed:
        v = getattr(value, name)
        storage = v.untyped_storage()
        seen[storage.data_ptr()] = storage
        key = (v.data_ptr(), v.numel())
        if key not in copies:
            copies[key] = _copy_alone(v)
        changes[name] = copies[key]
    return dataclasses.replace(value, **changes)


def _copy_alone(v: torch.Tensor) -> torch.Tensor:
    """A copy of the contiguous tensor ``v`` made by this thread alone (a plain memcpy): a
    result is copied out while the workers still compute, and a copy on torch's team of
    threads would leave its threads spinning after it, on the cores the workers run on."""
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    if v.numel():
        ctypes.memmove(out.data_ptr(), v.data_ptr(), v.numel() * v.element_size())
    return out


def _noop(_: int) -> None:
    return None


def _shutdown(pool: ProcessPoolExecutor) -> None:
    pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["ParallelExecutor", "fork_available", "part_sizes"]
