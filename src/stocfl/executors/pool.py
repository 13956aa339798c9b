"""Memory for a chunk's stacked weights, reused from round to round.

A batched chunk stacks its clients' start weights into one new tensor, trains it in place and
hands its rows out as the replies. On the CPU such a tensor (hundreds of MB at the paper's
scale) comes from the system as fresh pages each time, and the kernel's mapping of them costs
more than the copy itself. The pool keeps the chunks' tensors once their replies are gone and
hands them to the next chunk: the same copy into memory already mapped.

A tensor is handed out again only when nothing else refers to its memory: the pool counts the
references to its storage (every view of it, the replies' rows among them, holds one), so a
reply an algorithm keeps (a personal model, a stored update) keeps its rows out of the pool
for as long as it lives. The numbers are those of a fresh tensor: every row is written before
it is read.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Iterator

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _refs(t: torch.Tensor) -> int:
    assert _use_count is not None
    return int(_use_count(t.untyped_storage()._cdata))


def _default_budget() -> int:
    """A third of the machine's memory: at most that much is kept between chunks."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 3
    except (AttributeError, ValueError, OSError):
        return 4 << 30


class RowPool:
    """Tensors of rows x columns, reused once nothing refers to them (CPU only)."""

    def __init__(self, budget: int | None = None):
        self.budget = _default_budget() if budget is None else budget
        self.buffers: list[torch.Tensor] = []
        self.enabled = _use_count is not None
        self.alone = _refs(torch.empty(1)) if self.enabled else 0  # the count of a tensor held once
        self.reused = 0  # chunks served from the pool (for tests and benchmarks)
        self._lock = threading.Lock()  # two threads must not both find one tensor free and take it

    def _free(self, t: torch.Tensor) -> bool:
        return _refs(t) == self.alone

    def free_bytes(self) -> int:
        """Bytes of the kept tensors that nothing refers to (a next chunk takes them)."""
        if not self.enabled:
            return 0
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self.buffers if self._free(b))

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous rows x cols tensor whose values are undefined (the caller writes them all)."""
        if not self.enabled or device.type != "cpu":
            return torch.empty(rows, cols, dtype=dtype, device=device)
        with self._lock:  # the view handed out holds a reference before another thread looks
            return self._take(rows, cols, dtype, device)

    def _take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        best = None
        for buf in self.buffers:
            fits = buf.dtype == dtype and buf.shape[1] == cols and buf.shape[0] >= rows
            if fits and (best is None or buf.shape[0] < best.shape[0]) and self._free(buf):
                best = buf
        if best is not None:
            self.reused += 1
            return best[:rows]
        fresh = torch.empty(rows, cols, dtype=dtype, device=device)
        self.buffers.append(fresh)
        self._trim()
        return fresh[:rows]

    def _trim(self) -> None:
        """Drop tensors beyond the budget, unused ones first (one in use lives on with its replies)."""
        total = sum(b.numel() * b.element_size() for b in self.buffers)
        for buf in sorted(self.buffers[:-1], key=lambda b: (not self._free(b), -b.numel())):
            if total <= self.budget:
                break
            self.buffers = [b for b in self.buffers if b is not buf]
            total -= buf.numel() * buf.element_size()


# glibc's mallopt parameters and the defaults they are put back to
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_DEFAULT_TRIM, _DEFAULT_MMAP_MAX = 128 * 1024, 65536
_kept = 0  # runs inside keep_freed_memory() now (a comparison's runs, threads)
_kept_lock = threading.Lock()


@functools.cache  # platform.libc_ver reads the interpreter's binary: once a process
def _glibc():
    """The C library when it is glibc (whose allocator :func:`keep_freed_memory` tunes), else None."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


@contextlib.contextmanager
def keep_freed_memory() -> Iterator[bool]:
    """Keep the memory tensors free within this block for the next ones (yields whether it does).

    glibc serves every allocation over its mmap threshold (128 KB to 32 MB) with fresh pages
    from the kernel and hands them back when freed. A round's model-sized temporaries (a
    chunk's gradients, its proximal differences, the replies' checks: hundreds of MB when a
    hundred clients train at once) then cost a page fault and a zeroed page every 4 KB, every
    step, more than the arithmetic that fills them. Inside this block the allocator serves them
    from its heap and keeps what is freed there for the next allocation; at its end the old
    settings return and the free memory goes back to the system (``malloc_trim``). What is kept
    is what the run itself freed, so the memory held is about the run's peak (blocks freed in
    the heap's middle may not fit the next tensor: a little above it). Numbers do not
    change (a tensor's alignment is torch's own, whatever serves it). Elsewhere than glibc, or
    with ``STOCFL_KEEP_FREED_MEMORY=0`` in the environment, it does nothing.
    """
    global _kept
    libc = _glibc() if os.environ.get("STOCFL_KEEP_FREED_MEMORY", "1") != "0" else None
    if libc is None:
        yield False
        return
    with _kept_lock:
        if _kept == 0:
            libc.mallopt(_M_MMAP_MAX, 0)
            libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
        _kept += 1
    try:
        yield True
    finally:
        with _kept_lock:
            _kept -= 1
            if _kept == 0:
                libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                libc.mallopt(_M_TRIM_THRESHOLD, _DEFAULT_TRIM)
                libc.malloc_trim(0)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _system_memory() -> tuple[int, int] | None:
    """(total, available) bytes of this machine (``MemTotal``; ``MemAvailable`` plus swap
    free), or None where the system does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
        return info["MemTotal"], info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, KeyError, ValueError, IndexError):
        return None


def available_bytes(at_least: int = 0) -> int | None:
    """Memory a new allocation of this process can have without the system running out: what
    the system has available (``MemAvailable``, swap free) and what this process's heap holds
    free (glibc's ``mallinfo2``: the memory a run keeps for its next tensors,
    :func:`keep_freed_memory`). The heap is asked only where the system's figure is under
    ``at_least`` (it walks the heap's free blocks: milliseconds in a fragmented heap). None
    where the system's figure is not known (not Linux)."""
    memory = _system_memory()
    if memory is None:
        return None
    free = memory[1]
    return free if free >= at_least else free + heap_free_bytes()


def heap_free_bytes() -> int:
    """Bytes this process's heap holds free for its next allocations (glibc ``mallinfo2``;
    0 where it cannot be asked)."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _Mallinfo2
    return int(libc.mallinfo2().fordblks)


def give_back_when_short(share: float = 0.125) -> bool:
    """Inside :func:`keep_freed_memory`, hand the heap's free memory back to the system when the
    system runs short: when what it has left (available memory and swap) is under ``share``
    of its memory. Whether it did. A run calls it after each round.

    The heap keeps freed memory for the next round's tensors, which is about the round's
    transients while they keep their sizes. A run whose state grows (clusters added a round)
    asks each round for tensors a little larger than the freed ones, which the freed blocks
    do not fit: the heap then holds the old sizes as well, and the process's memory grows with
    them. What is kept costs nothing while the system has room; when it runs short (another
    run beside this one), the memory a heap keeps idle is what it can give back, at the cost of
    its next round's page faults. (The heap's own count of free bytes cannot decide it: it
    still counts the free blocks whose pages went back.) The numbers do not change."""
    libc = _glibc()
    if libc is None or _kept == 0:
        return False
    memory = _system_memory()
    if memory is None or memory[1] >= share * memory[0]:
        return False
    libc.malloc_trim(0)
    return True


def trim_freed_memory() -> bool:
    """Hand the memory this process has freed back to the system (glibc's ``malloc_trim``;
    elsewhere nothing); whether it could. A run trims when it ends, while its own state still
    lives; a process that runs one experiment after another (a bench) trims between them, so
    that what one left free in the heap's middle does not add to the next one's peak."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


__all__ = [
    "RowPool",
    "available_bytes",
    "give_back_when_short",
    "heap_free_bytes",
    "keep_freed_memory",
    "trim_freed_memory",
]
