"""Where client work runs: ``run.device = "auto" | "cpu" | "cuda" | "cuda:N" | "mps"``.

The server's state (algorithms, checkpoints, stores) stays on the CPU. An executor holds the
federation's data on its device, moved there once, and moves each task's tensors there and
each result's tensors back: one copy of a model per task each way, against the task's
training work.
"""

from __future__ import annotations

import dataclasses
import platform
import re
from collections.abc import Callable
from typing import Any

import torch

from stocfl.errors import UserError

DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d{1,3}|mps)$")


def resolve_device(name: str) -> torch.device:
    """The torch device for ``run.device``; one line naming what is missing otherwise."""
    if not isinstance(name, str) or not DEVICE.match(name):
        raise UserError(f"config: run.device = {name!r}; choose auto, cpu, cuda, cuda:N or mps")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(
                f"config: run.device = {name!r}, but this machine has no CUDA device torch can use; use cpu or auto"
            )
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise UserError(
                f"config: run.device = {name!r}, but this machine has {torch.cuda.device_count()} CUDA "
                f"device(s) (cuda:0..cuda:{torch.cuda.device_count() - 1})"
            )
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UserError("config: run.device = 'mps', but this machine has no Apple GPU torch can use; use cpu or auto")
    return torch.device(name)


def describe(device: torch.device) -> str:
    """The processor that computes on ``device``, as a run records it: an accelerator's name, or
    the CPU's model and the instruction set torch's kernels use on it. Runs agree to the bit only
    on the same kind of processor with the same torch threads; kernels for another instruction
    set or thread count round differently, and training amplifies it within a few rounds."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple GPU (mps)"
    model = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {torch.backends.cpu.get_cpu_capability()}"


def free_bytes(device: torch.device) -> int | None:
    """Free memory on an accelerator (None on the CPU, where the executors' fixed budget holds)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def move(value: Any, device: torch.device, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """A task or result dataclass with its tensor fields on ``device``. Tensors shared between
    tasks (every client on the global model) are moved once: ``memo`` maps id -> moved copy, so
    tasks that shared a tensor still share one."""
    return map_tensors(value, lambda v: v.device != device, lambda v: v.to(device), memo)


def map_tensors(
    value: Any,
    applies: Callable[[torch.Tensor], bool],
    fn: Callable[[torch.Tensor], torch.Tensor],
    memo: dict[int, torch.Tensor] | None = None,
) -> Any:
    """A dataclass with ``fn`` applied to each tensor field for which ``applies`` holds, once per
    tensor (``memo``: id -> result); anything else is returned as it is."""
    if not dataclasses.is_dataclass(value):
        return value
    memo = {} if memo is None else memo
    changes = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if isinstance(v, torch.Tensor) and applies(v):
            if id(v) not in memo:
                memo[id(v)] = fn(v)
            changes[f.name] = memo[id(v)]
    return dataclasses.replace(value, **changes) if changes else value


def federation_on(fed, device: torch.device):
    """The federation with its data tensors on ``device`` (itself on the CPU)."""
    if device.type == "cpu":
        return fed
    return dataclasses.replace(
        fed,
        **{
            f.name: getattr(fed, f.name).to(device)
            for f in dataclasses.fields(fed)
            if isinstance(getattr(fed, f.name), torch.Tensor)
        },
    )
