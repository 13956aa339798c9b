"""Algorithm state as a value, and its checkpoint form.

An algorithm keeps everything that must outlive a round in one dataclass instance, its
``State``. Fields may hold tensors, numpy arrays, plain data (None, bool, int, float, str),
lists, tuples and dicts (int or str keys) of these, and components that checkpoint
themselves: objects with ``state() -> (tensors, meta)`` and ``load_state(tensors, meta)``,
such as a :class:`~stocfl.storage.store.ClientStore` (rows on disk) or a
:class:`~stocfl.algorithms.stocfl.clustering.ClusterSet`.

:func:`encode` turns a state into tensors and JSON-able meta (what a checkpoint file holds,
and what the runner keeps in memory to replay a failed round); :func:`decode` turns them back,
every tensor a copy both ways (an encoded state shares no memory with the algorithm); a
field declared with a default that an older checkpoint lacks keeps its starting value, so
adding one does not stop older runs from resuming. Lists and dicts of tensors of one shape
are stored stacked, as one tensor. Nothing here knows any algorithm.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np
import torch

FORMAT = 2  # the layout of encoded state; a checkpoint of another layout is refused


class StateError(ValueError):
    """A value that cannot be checkpointed, or an encoded state that does not fit."""


def encode(value: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A state dataclass as (tensors by name, JSON-able meta), copied."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise StateError(f"state must be a dataclass instance, got {type(value).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    fields = {f.name: _enc(getattr(value, f.name), f.name, tensors) for f in dataclasses.fields(value)}
    return tensors, {"format": FORMAT, "fields": fields}


def decode(tensors: dict[str, torch.Tensor], meta: dict[str, Any], like: Any) -> Any:
    """The state that :func:`encode` gave (tensors, meta) for, built on ``like`` (a state of the
    same class): its components load their part in place, every other field is replaced."""
    if meta.get("format") != FORMAT:
        raise StateError(f"state layout {meta.get('format')!r}, expected {FORMAT} (written by another version)")
    out = copy.copy(like)
    for f in dataclasses.fields(like):
        if f.name not in meta["fields"]:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise StateError(f"state field {f.name!r} is missing")
            continue  # a field added later, with a default: an older checkpoint keeps the starting value
        object.__setattr__(out, f.name, _dec(meta["fields"][f.name], tensors, getattr(like, f.name)))
    return out


def _stackable(values: list[Any]) -> bool:
    return (
        bool(values)
        and all(isinstance(v, torch.Tensor) for v in values)
        and all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values)
    )


def _enc(v: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(v, torch.Tensor):
        tensors[path] = v.detach().clone()
        return {"$t": path}
    if isinstance(v, np.ndarray):
        tensors[path] = torch.from_numpy(np.array(v, order="C"))
        return {"$a": path}
    if isinstance(v, np.generic):
        v = v.item()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        tag = "$tuple" if isinstance(v, tuple) else "$list"
        if _stackable(list(v)):
            tensors[path] = torch.stack([x.detach() for x in v])
            return {tag: path, "stacked": True}
        return {tag: [_enc(x, f"{path}/{k}", tensors) for k, x in enumerate(v)]}
    if isinstance(v, dict):
        keys = list(v)
        bad = [k for k in keys if isinstance(k, bool) or not isinstance(k, (int, str, np.integer))]
        if bad:
            raise StateError(f"state field {path}: dict key {bad[0]!r} is not an int or a str")
        keys = [int(k) if isinstance(k, np.integer) else k for k in keys]
        values = list(v.values())
        if _stackable(values):
            tensors[path] = torch.stack([x.detach() for x in values])
            return {"$dict": path, "keys": keys}
        return {"$dict": [[k, _enc(x, f"{path}/{j}", tensors)] for j, (k, x) in enumerate(zip(keys, values))]}
    if callable(getattr(v, "state", None)) and callable(getattr(v, "load_state", None)):
        part, meta = v.state()
        tensors.update({f"{path}/{k}": x for k, x in part.items()})
        return {"$component": path, "meta": meta}
    raise StateError(
        f"state field {path}: a {type(v).__name__} cannot be checkpointed; use tensors, numpy arrays, "
        f"plain data, lists and dicts of them, or an object with state() and load_state()"
    )


def _tensor(tensors: dict[str, torch.Tensor], path: str) -> torch.Tensor:
    if path not in tensors:
        raise StateError(f"state tensor {path!r} is missing")
    return tensors[path]


def _dec(m: Any, tensors: dict[str, torch.Tensor], current: Any) -> Any:
    if not isinstance(m, dict):
        return m
    if "$t" in m:
        return _tensor(tensors, m["$t"]).clone()
    if "$a" in m:
        return _tensor(tensors, m["$a"]).numpy().copy()
    for tag, kind in (("$list", list), ("$tuple", tuple)):
        if tag in m:
            if m.get("stacked"):
                return kind(x.clone() for x in _tensor(tensors, m[tag]))
            return kind(_dec(x, tensors, None) for x in m[tag])
    if "$dict" in m:
        if "keys" in m:
            return {k: x.clone() for k, x in zip(m["keys"], _tensor(tensors, m["$dict"]))}
        return {k: _dec(x, tensors, None) for k, x in m["$dict"]}
    if "$component" in m:
        if current is None:
            raise StateError(f"state field {m['$component']!r}: a component needs an object to load into")
        prefix = m["$component"] + "/"
        current.load_state({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, m["meta"])
        return current
    raise StateError(f"unknown state entry {sorted(m)}")
