"""Client tasks and results as Flower records, derived from the dataclass fields of each
registered task kind (``stocfl.client.tasks.register_task``): no per-kind code here.

One message carries the tasks of one kind for the clients of one node in a call of the
executor (e.g. StoCFL's train of w and of theta_k). Task k travels as an ArrayRecord "k.arrays"
(its tensor fields; a field that is None is left out) and a ConfigRecord "k.task" (its other
fields: numbers and strings; a field that is a dataclass, such as the local-training settings,
by its fields under dotted names, "local.optimizer.lr"), with a ConfigRecord "batch" holding
the count; the message type is the kind's. Result k comes back as "k.arrays" and a
ConfigRecord "k.values" the same way, with a ConfigRecord "clients" whose "ids" name the client
of each result. Every value is read back by its field's type: a number where an integer
belongs, a string outside a Literal's values, NaN or inf in a tensor, a tensor of the wrong
shape class, a missing field or another client's id is a :class:`BadReply`. Replies are then
checked against the task (``stocfl.client.tasks.check_result``) before any algorithm sees them.

Decoding a reply cannot raise anything but :class:`BadReply` and never allocates more than the
task allows: a client id must be an integer (a float only if whole and finite; never a string,
bytes or bool); a tensor's bytes are read by one bounded parser that takes the npy header
apart before any allocation (format 1.0 or 2.0, a real integer or floating dtype of at most
8 bytes, little-endian or single-byte; no object, bool, complex, string, date or structured
dtype), refuses a declared size beyond what the task kind allows a reply
(``TaskKind.max_reply``, summed over the reply's tensors) or bytes that do not match the header
exactly, and only then views the bytes; anything else that goes wrong while reading is a
BadReply too.
"""

from __future__ import annotations

import io
import math
import typing
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from stocfl.client.tasks import KINDS, BadResult, Task, kind_by_message, kind_of


class BadReply(BadResult):
    """A client's reply that must not reach aggregation (wrong shape, NaN or inf, wrong client)."""


def message_type(task_type: type) -> str:
    return kind_of(task_type).message


def message_types() -> list[str]:
    return sorted(k.message for k in KINDS.values())


@dataclass(frozen=True)
class _Field:
    kind: str  # "tensor" | "int" | "float" | "str" | "bool"
    optional: bool
    default: object
    choices: tuple = ()  # a Literal's values


@cache
def _layout(cls: type) -> tuple[tuple[str, _Field | tuple], ...]:
    """Per field of ``cls``: (name, its _Field) or, for a field that is itself a dataclass
    (the local-training settings), (name, (its class, its default))."""
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, _Field | tuple]] = []
    for f in fields(cls):
        base = hints[f.name]
        optional = type(None) in typing.get_args(base)
        if optional:  # X | None
            base = next(a for a in typing.get_args(base) if a is not type(None))
        choices: tuple = ()
        if is_dataclass(base) and not optional:
            out.append((f.name, (base, f.default)))
            continue
        if base is torch.Tensor:
            kind = "tensor"
        elif typing.get_origin(base) is typing.Literal:
            kind, choices = "str", typing.get_args(base)
        elif base in (bool, int, float, str):
            kind = base.__name__
        else:
            raise TypeError(
                f"{cls.__name__}.{f.name}: a message field must be a tensor, int, float, str, bool "
                f"or a dataclass of these"
            )
        out.append((f.name, _Field(kind, optional, f.default, choices)))
    return tuple(out)


def _encode(obj) -> tuple[ArrayRecord, ConfigRecord]:
    arrays: dict = {}
    values: dict = {}
    _flatten(obj, arrays, values, "")
    return ArrayRecord(array_dict=arrays), ConfigRecord(values)


def _flatten(obj, arrays: dict, values: dict, prefix: str) -> None:
    """``obj``'s tensor fields into ``arrays`` and its other fields into ``values``, a nested
    dataclass's under its field's name and a dot."""
    for name, spec in _layout(type(obj)):
        v = getattr(obj, name)
        if isinstance(spec, tuple):
            _flatten(v, arrays, values, f"{prefix}{name}.")
        elif spec.kind == "tensor":
            if v is not None:
                arrays[prefix + name] = Array(v.detach().numpy())
        elif v is not None:
            values[prefix + name] = v.item() if isinstance(v, np.generic) else v


def _value(spec: _Field, key: str, v):
    """``v`` read as ``spec`` says, or a BadReply naming ``key``."""
    if spec.kind == "int":
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or (isinstance(v, float) and not (math.isfinite(v) and v.is_integer()))
        ):
            raise BadReply(f"{key} = {v!r} is not an integer")
        return int(v)
    if spec.kind == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadReply(f"{key} = {v!r} is not a number")
        if not math.isfinite(v):
            raise BadReply(f"{key} = {v!r} is not finite")
        return float(v)
    if spec.kind == "bool":
        if not isinstance(v, bool):
            raise BadReply(f"{key} = {v!r} is not true or false")
        return v
    if not isinstance(v, str):
        raise BadReply(f"{key} = {v!r} is not a string")
    if spec.choices and v not in spec.choices:
        raise BadReply(f"{key} = {v!r} is not one of {', '.join(map(repr, spec.choices))}")
    return v


NUMBER_KINDS = "iuf"  # signed and unsigned integers, floats
NPY_VERSIONS = ((1, 0), (2, 0))


class _Budget:
    """The numbers a reply's tensors may still carry."""

    def __init__(self, left: int):
        self.left = left

    def take(self, count: int, key: str) -> None:
        if count > self.left:
            raise BadReply(f"{key} declares {count:,} numbers, more than the task allows its reply")
        self.left -= count


def _tensor(a, key: str, budget: _Budget | None) -> torch.Tensor:
    """One Flower Array read by the bounded parser (module docstring), as float32."""
    if not isinstance(a, Array) or a.stype != "numpy.ndarray":
        raise BadReply(f"{key}: not a serialised numpy array")
    data = a.data
    if not isinstance(data, bytes):
        raise BadReply(f"{key}: its data are not bytes")
    f = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(f)
        if version not in NPY_VERSIONS:
            raise ValueError(f"npy format {version}")
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f, max_header_size=10_000)
    except Exception as err:  # noqa: BLE001 - whatever the header holds: one bad reply
        raise BadReply(f"{key}: not an npy array ({type(err).__name__}: {err})"[:300]) from None
    if (
        dtype.hasobject
        or dtype.fields is not None
        or dtype.subdtype is not None
        or dtype.kind not in NUMBER_KINDS
        or dtype.itemsize > 8
        or (dtype.itemsize > 1 and dtype.byteorder == ">")
    ):
        raise BadReply(f"{key}: dtype {dtype.str} is not a little-endian integer or float of at most 8 bytes")
    if not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BadReply(f"{key}: shape {shape!r} is not a tuple of sizes")
    count = math.prod(shape)
    if budget is not None:
        budget.take(count, key)
    start = f.tell()
    if len(data) - start != count * dtype.itemsize:
        raise BadReply(f"{key}: {len(data) - start} bytes of data for {count:,} numbers of {dtype.itemsize} bytes")
    values = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape, order="F" if fortran else "C")
    t = torch.from_numpy(values.astype(np.float32))
    if t.numel() and not bool(torch.isfinite(t).all()):
        raise BadReply(f"{key} holds NaN or inf")
    return t


def _read(cls: type, arrays: ArrayRecord, values: ConfigRecord, prefix: str = "", budget: _Budget | None = None):
    """An instance of ``cls`` from its records, each value checked against its field's type,
    its tensors together within ``budget`` numbers (None: a task from the server, not bounded)."""
    kw = {}
    for name, spec in _layout(cls):
        key = prefix + name
        if isinstance(spec, tuple):
            sub, default = spec
            present = any(k.startswith(key + ".") for k in (*arrays.keys(), *values.keys()))
            if present or default is MISSING:
                kw[name] = _read(sub, arrays, values, key + ".", budget)
            continue
        if spec.kind == "tensor":
            if key in arrays:
                kw[name] = _tensor(arrays[key], key, budget)
            elif spec.optional or spec.default is not MISSING:
                kw[name] = None if spec.optional else spec.default
            else:
                raise BadReply(f"{key} is missing")
            continue
        if key not in values:
            if spec.default is MISSING:
                raise BadReply(f"{key} is missing")
            continue
        kw[name] = _value(spec, key, values[key])
    try:
        return cls(**kw)
    except (TypeError, ValueError) as err:  # a dataclass that checks its values refuses them
        raise BadReply(f"{prefix or cls.__name__}: {err}") from None


def encode_tasks(tasks: list[Task]) -> RecordDict:
    """One message's content: tasks of one kind."""
    if len({type(t) for t in tasks}) != 1:
        raise ValueError("one message carries tasks of one kind")
    content = RecordDict({"batch": ConfigRecord({"n": len(tasks)})})
    for k, task in enumerate(tasks):
        content[f"{k}.arrays"], content[f"{k}.task"] = _encode(task)
    return content


def decode_tasks(message: str, content: RecordDict) -> list[Task]:
    cls = kind_by_message(message).task
    return [_read(cls, content[f"{k}.arrays"], content[f"{k}.task"]) for k in range(int(content["batch"]["n"]))]


def encode_results(results: list, clients: list[int]) -> RecordDict:
    """The reply to one message: ``results[k]`` is client ``clients[k]``'s."""
    content = RecordDict({"clients": ConfigRecord({"ids": [int(c) for c in clients]})})
    for k, result in enumerate(results):
        content[f"{k}.arrays"], content[f"{k}.values"] = _encode(result)
    return content


_CLIENT_ID = _Field("int", False, MISSING)


def client_ids(raw, what: str = "ids") -> list[int]:
    """A list of client ids as sent (a reply's, a node's claims): each an integer, or a whole
    finite float; anything else (inf, 3.7, "3", b"\\x03", True, a lone number) is a BadReply."""
    if not isinstance(raw, (list, tuple)):
        raise BadReply(f"{what} = {raw!r:.80} is not a list of client ids")
    return [_value(_CLIENT_ID, what, c) for c in raw]


def decode_results(tasks: list[Task], content: RecordDict) -> list:
    """The replies to ``tasks`` (one message's), each read by its kind's result fields and
    from the client it was asked of. Raises only :class:`BadReply`."""
    try:
        return _decode_results(tasks, content)
    except BadReply:
        raise
    except Exception as err:  # noqa: BLE001 - a reply that breaks the reading is a bad reply, whatever broke
        raise BadReply(f"reply could not be read ({type(err).__name__}: {err})"[:300]) from None


def _decode_results(tasks: list[Task], content: RecordDict) -> list:
    try:
        clients = content["clients"]
        who = client_ids(clients["ids"] if isinstance(clients, ConfigRecord) else None)
        parts = [(content[f"{k}.arrays"], content[f"{k}.values"]) for k in range(min(len(tasks), len(who)))]
    except KeyError as err:
        raise BadReply(f"reply without the expected records ({err})") from None
    if len(who) != len(tasks) or len(content) != 1 + 2 * len(tasks):
        raise BadReply(f"reply holds {(len(content) - 1) // 2} results for {len(tasks)} tasks")
    out = []
    for t, c, (arrays, values) in zip(tasks, who, parts):
        if c != t.client:
            raise BadReply(f"reply from client {c} to a task for client {t.client}")
        if not isinstance(arrays, ArrayRecord) or not isinstance(values, ConfigRecord):
            raise BadReply("reply records of the wrong kind")
        kind = kind_of(type(t))
        out.append(_read(kind.result, arrays, values, budget=_Budget(kind.max_reply(t))))
    return out
