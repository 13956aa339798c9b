"""Checkpoints without pickle: one safetensors file, the JSON state in its metadata header.

Written to a temporary name and moved into place with ``os.replace``, so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one. A SHA-256 of the
state (the JSON and every tensor's name, dtype, shape and bytes) is stored beside it and
checked on load: a flipped byte anywhere is an error, never a silently different run. A file
without one is refused (every stocfl since checkpoints began to carry it writes one), so that
dropping the checksum is not a way past it. The SHA-256 is not a key: it catches damage and
edits, not a forger who recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as to_bytes

from stocfl.errors import UserError
from stocfl.storage.files import write_atomic, write_atomic_with


def digest(tensors: dict[str, torch.Tensor], meta_json: str) -> str:
    """SHA-256 of the JSON state and every tensor's name, dtype, shape and bytes (in name
    order), the bytes read where they lie (no copy of a tensor that is contiguous)."""
    h = hashlib.sha256(meta_json.encode())
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"\0{k}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(_bytes_of(t))
    return h.hexdigest()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of the contiguous CPU tensor ``t``, a view of its own memory."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# safetensors' names of the dtypes it stores (others go through the library, whole in memory)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """A safetensors file of ``tensors`` with ``meta`` (JSON) and the checksum in its header,
    written a tensor at a time. A checkpoint is the algorithm's whole state (StoCFL with a
    model-sized Psi keeps a float64 sum per cluster: gigabytes); the library's writer builds
    the file in memory first, and the checksum read each tensor through a copy of its bytes,
    so a checkpoint once took three times the state's memory at the end of every round."""
    meta_json = json.dumps(meta)
    tensors = {k: v.detach() for k, v in tensors.items()}
    sha = digest(tensors, meta_json)
    if any(t.dtype not in _SAFETENSORS_DTYPES or t.device.type != "cpu" for t in tensors.values()):
        plain = {k: v.contiguous() for k, v in tensors.items()}
        write_atomic(path, to_bytes(plain, metadata={"stocfl": meta_json, "sha256": sha}))
        return
    # as the library lays them out: the widest elements first, so that every tensor's bytes
    # start at a multiple of its element size
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    entries: dict[str, Any] = {"__metadata__": {"stocfl": meta_json, "sha256": sha}}
    offset = 0
    for k in order:
        t = tensors[k]
        size = t.numel() * t.element_size()
        entries[k] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = _header(entries)

    def write(f) -> None:
        f.write(head)
        for k in order:
            if tensors[k].numel():
                f.write(_bytes_of(tensors[k].contiguous()))

    write_atomic_with(path, write)


def _header(entries: dict[str, Any]) -> bytes:
    """A safetensors header: its length (8 bytes, little-endian), then the JSON of ``entries``
    (``__metadata__`` and each tensor's dtype, shape and offsets), padded with spaces to a
    multiple of 8 bytes, as the library pads it."""
    head = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head


def save_rows(path: Path, name: str, rows, n_rows: int, n_cols: int, meta: dict[str, Any], sync: bool = True) -> None:
    """What ``save(path, {name: (n_rows, n_cols) float32}, meta)`` writes, with the rows taken
    one at a time from ``rows`` (an iterable of float32 arrays), so that writing them never
    holds more than one: the undo log of a store of large models stays off the heap. Moved into
    place by a rename either way (a killed process leaves the old file or the new one);
    ``sync=False`` leaves the forcing of its bytes to the disk to the system."""
    meta_json = json.dumps(meta)
    h = hashlib.sha256(meta_json.encode())
    h.update(f"\0{name}\0{torch.float32}\0{(n_rows, n_cols)}\0".encode())
    size = n_rows * n_cols * 4

    def header(sha: str) -> bytes:
        return _header(
            {
                "__metadata__": {"stocfl": meta_json, "sha256": sha},
                name: {"dtype": "F32", "shape": [n_rows, n_cols], "data_offsets": [0, size]},
            }
        )

    placeholder = header("0" * 64)  # a SHA-256 is 64 hex digits: the real header has the same length

    def write(f) -> None:
        f.write(placeholder)
        written = 0
        for row in rows:
            b = memoryview(np.ascontiguousarray(row, dtype=np.float32)).cast("B")
            if len(b) != n_cols * 4:
                raise ValueError(f"save_rows: a row of {len(b) // 4} numbers, expected {n_cols}")
            h.update(b)
            f.write(b)
            written += 1
        if written != n_rows:
            raise ValueError(f"save_rows: {written} rows, expected {n_rows}")
        f.seek(0)
        f.write(header(h.hexdigest()))

    write_atomic_with(path, write, sync)


def _unreadable(path: Path, err: Exception) -> UserError:
    return UserError(f"checkpoint {path} is unreadable ({type(err).__name__}); the run cannot resume from it")


def _checksum(path: Path, header: dict[str, str] | None) -> str:
    """The checksum the header carries; a header without one is refused."""
    stored = (header or {}).get("sha256")
    if not isinstance(stored, str) or len(stored) != 64:
        raise UserError(
            f"checkpoint {path} carries no checksum (its header has no sha256): it was edited, or written "
            f"by a stocfl from before 2026-11-23; the run cannot resume from it"
        )
    return stored


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON state alone (the header), without reading or checking the tensors (the
    checksum must be there)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata()
            meta = json.loads(header["stocfl"])
            if not isinstance(meta, dict):
                raise ValueError("its state is not a JSON object")
    except Exception as err:  # a truncated or foreign file, whatever the library raises
        raise _unreadable(path, err) from None
    _checksum(path, header)
    return meta


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata()
            meta_json = header["stocfl"]
            meta = json.loads(meta_json)
            if not isinstance(meta, dict):
                raise ValueError("its state is not a JSON object")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:
        raise _unreadable(path, err) from None
    if _checksum(path, header) != digest(tensors, meta_json):
        raise UserError(
            f"checkpoint {path} is corrupt (its checksum does not match its contents); the run cannot resume from it"
        )
    return tensors, meta
