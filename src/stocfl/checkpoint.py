"""Checkpoints without pickle: one safetensors file, the JSON state in its metadata header.

Written to a temporary name and moved into place with ``os.replace``, so a kill at any moment
leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from stocfl.errors import UserError


def save(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"stocfl": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["stocfl"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # a truncated or foreign file, whatever the library raises
        raise UserError(f"checkpoint {path} is unreadable ({type(err).__name__}); the run cannot resume from it") from None
    return tensors, meta
