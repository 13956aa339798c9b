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

import os
import threading

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


__all__ = ["RowPool"]
