"""Checkpoints without pickle: one safetensors file, the JSON state in its metadata header.

Written to a temporary name and moved into place with ``os.replace``, so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one. A SHA-256 of the
state (the JSON and every tensor's name, dtype, shape and bytes) is stored beside it and
checked on load: a flipped byte anywhere is an error, never a silently different run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as to_bytes

from stocfl.errors import UserError
from stocfl.files import write_atomic


def digest(tensors: dict[str, torch.Tensor], meta_json: str) -> str:
    h = hashlib.sha256(meta_json.encode())
    for k in sorted(tensors):
        t = tensors[k].detach().contiguous().cpu()
        h.update(f"\0{k}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    meta_json = json.dumps(meta)
    write_atomic(path, to_bytes(tensors, metadata={"stocfl": meta_json, "sha256": digest(tensors, meta_json)}))


def _unreadable(path: Path, err: Exception) -> UserError:
    return UserError(f"checkpoint {path} is unreadable ({type(err).__name__}); the run cannot resume from it")


def read_meta(path: Path) -> dict[str, Any]:
    """The JSON state alone (the header), without reading or checking the tensors."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return json.loads(f.metadata()["stocfl"])
    except Exception as err:  # a truncated or foreign file, whatever the library raises
        raise _unreadable(path, err) from None


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata()
            meta_json = header["stocfl"]
            meta = json.loads(meta_json)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:
        raise _unreadable(path, err) from None
    stored = header.get("sha256")
    if stored is not None and stored != digest(tensors, meta_json):
        raise UserError(f"checkpoint {path} is corrupt (its checksum does not match its contents); the run cannot "
                        f"resume from it")
    return tensors, meta
