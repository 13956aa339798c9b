"""The codec's record space fuzzed for every registered task kind: whatever a client puts in a
reply (ids of any type, arrays of any dtype, shape, header or bytes, values of any type,
records missing or added), decoding answers the honest reply, or a reply that passes the kind's
check, or drops the client (BadReply / BadResult): never another exception, never an
allocation beyond what the task allows."""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import fields

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stocfl.client.mixture import evaluation_task
from stocfl.client.tasks import BUILTIN_MESSAGES, KINDS, BadResult, check_result, kind_of
from stocfl.executors import SequentialExecutor
from stocfl.flower.codec import BadReply, decode_results, encode_results
from tests.test_common import FED, MODEL, PARAMS, SAMPLES, make, play


class Asked:
    def __init__(self, inner):
        self.inner, self.fed, self.model = inner, inner.fed, inner.model
        self.first: dict[type, object] = {}

    def execute(self, tasks):
        for t in tasks:
            self.first.setdefault(type(t), t)
        return self.inner.execute(tasks)


def _honest_pairs():
    """One task of every registered kind, as the built-in algorithms ask it, and its honest reply."""
    asked = Asked(SequentialExecutor(FED, MODEL))
    for name in [
        "fedavg",
        "stocfl",
        "fedem",
        "fedsoft",
        "pacfl",
        "flux",
        "fedccfa",
        "cfl:gradients",
    ]:
        alg = play(make(name), asked, SAMPLES[:2])
        client = SAMPLES[0][0]
        asked.execute([evaluation_task(client, alg.client_models([client], asked.execute)[0])])
    pairs = {}
    for kind, task in asked.first.items():
        (result,) = asked.inner.execute([task])
        pairs[kind.__name__] = (task, result)
    return pairs


PAIRS = _honest_pairs()


def test_every_registered_kind_is_fuzzed():
    builtin = {k.task.__name__ for k in KINDS.values() if k.message in BUILTIN_MESSAGES}  # a test may add its own
    assert set(PAIRS) == builtin, builtin - set(PAIRS)
    assert "fedccfa" in PARAMS


def npy(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values, allow_pickle=False)
    return buf.getvalue()


def header_only(shape: tuple, dtype: str = "<f4") -> bytes:
    """An npy header declaring ``shape`` with no data after it."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue()


ODD_VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.binary(max_size=5),
    st.booleans(),
    st.lists(st.integers(-5, 5), max_size=3),
    st.lists(st.floats(allow_nan=True), max_size=3),
)

ODD_ARRAYS = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    st.just(("bytes", b"")),
    st.sampled_from(
        [
            ("npy", np.array([True, False])),
            ("npy", np.array([1 + 2j, 3j])),
            ("npy", np.array(["ab", "c"])),
            ("npy", np.array([b"\x03"])),
            ("npy", np.array(["2020-01-01"], dtype="datetime64[D]")),
            ("npy", np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])),
            ("npy", np.zeros(3, dtype=">f4")),
            ("npy", np.zeros(3, dtype=np.longdouble)),
            ("npy", np.full(3, np.nan, dtype=np.float32)),
            ("npy", np.full(3, np.inf)),
            ("npy", np.zeros((2, 3, 0), dtype=np.float32)),
        ]
    ),
    st.tuples(st.integers(1, 10**12), st.sampled_from(["<f4", "<f8", "|u1"])).map(
        lambda a: ("header", header_only((a[0],), a[1]))
    ),
    st.integers(10**7, 2 * 10**7).map(lambda n: ("header", header_only((n,)))),
)


def _array(kind_and_value) -> Array:
    how, v = kind_and_value
    if how == "npy":
        return Array(dtype=str(v.dtype), shape=tuple(v.shape), stype="numpy.ndarray", data=npy(v))
    return Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=v)


def _copy(content: RecordDict) -> RecordDict:
    out = RecordDict()
    for key, rec in content.items():
        if isinstance(rec, ArrayRecord):
            out[key] = ArrayRecord(array_dict={k: a for k, a in rec.items()})
        else:
            out[key] = ConfigRecord(dict(rec))
    return out


def _same(a, b) -> bool:
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _answer(task, content, sizes):
    """What the server makes of a reply: ("dropped", why) or ("kept", the checked result)."""
    try:
        (got,) = decode_results([task], content)
        return "kept", check_result(task, got, *sizes)
    except (BadReply, BadResult) as err:
        return "dropped", str(err)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(PAIRS)),
    where=st.sampled_from(["ids", "array", "value", "drop", "add"]),
    odd=ODD_VALUES,
    arr=ODD_ARRAYS,
    pick=st.integers(0, 100),
)
def test_a_reply_mangled_anywhere_is_read_or_dropped_never_raises(name, where, odd, arr, pick):
    task, result = PAIRS[name]
    sizes = (len(FED.train_data(task.client)[1]), len(FED.test_data(task.client)[1]))
    honest = encode_results([result], [task.client])
    assert _answer(task, honest, sizes)[0] == "kept"
    content = _copy(honest)
    arrays, values = content["0.arrays"], content["0.values"]
    touched = where in ("ids", "add")
    if where == "ids":
        content["clients"] = ConfigRecord({"ids": odd if isinstance(odd, list) else [odd]})
    elif where == "array" and len(arrays):
        key = sorted(arrays.keys())[pick % len(arrays)]
        arrays[key] = _array(arr)
        touched = True
    elif where == "value" and len(values):
        key = sorted(values.keys())[pick % len(values)]
        try:
            values[key] = odd
        except (TypeError, ValueError):  # Flower's record refuses that type itself
            return
    elif where == "drop":
        keys = [("a", k) for k in arrays.keys()] + [("v", k) for k in values.keys()]
        if keys:
            rec, key = keys[pick % len(keys)]
            del (arrays if rec == "a" else values)[key]
    elif where == "add":
        content[f"{pick}.extra"] = ConfigRecord({"x": 1})
    verdict, got = _answer(task, content, sizes)
    if verdict == "kept":
        # only a reply that still reads as the honest one, or one within the kind's checks, is kept
        assert _same(got, result) or where in ("value", "array"), (name, where)
    is_the_id = not isinstance(odd, (bool, str, bytes, list)) and odd == task.client  # 0 or 0.0 for client 0
    if where == "ids" and not is_the_id:
        assert verdict == "dropped", (odd, got)
    if where == "array" and touched and arr[0] in ("bytes", "header"):
        assert verdict == "dropped", got


FORGED = {  # the task's client c, named otherwise
    "inf": lambda c: [math.inf],
    "-inf": lambda c: [-math.inf],
    "nan": lambda c: [math.nan],
    "c + 0.7": lambda c: [c + 0.7],
    "str(c)": lambda c: [str(c)],
    "bytes([c])": lambda c: [bytes([c])],
    "a lone number": lambda c: c,
    "a string of digits": lambda c: str(c),
    "10**30": lambda c: [10**30],
}


@pytest.mark.parametrize("how", list(FORGED))
def test_a_reply_naming_its_client_by_anything_but_its_integer_id_is_dropped(how):
    c = next(i for i in FED.participants if i >= 3)  # int(), bytes and float forms would read as c
    task = dataclasses.replace(PAIRS["Train"][0], client=c)
    (result,) = SequentialExecutor(FED, MODEL).execute([task])
    content = _copy(encode_results([result], [task.client]))
    try:
        content["clients"] = ConfigRecord({"ids": FORGED[how](task.client)})
    except (TypeError, ValueError):
        pytest.skip("Flower's records cannot carry this value")
    with pytest.raises(BadReply):
        decode_results([task], content)


def test_a_huge_declared_array_is_refused_before_any_allocation():
    """A 128-byte reply declaring 10^12 floats, and a 20M-float reply to a small task."""
    task, result = PAIRS["Train"]
    for data in (header_only((10**12,)), npy(np.zeros(20_000_000, dtype=np.float32))):
        content = _copy(encode_results([result], [task.client]))
        content["0.arrays"]["weights"] = Array(dtype="float32", shape=(1,), stype="numpy.ndarray", data=data)
        with pytest.raises(BadReply, match="more than the task allows"):
            decode_results([task], content)


def test_reply_sizes_follow_each_kind():
    for name, (task, result) in PAIRS.items():
        carried = sum(v.numel() for f in fields(result) if isinstance(v := getattr(result, f.name), torch.Tensor))
        assert carried <= kind_of(type(task)).max_reply(task), name
