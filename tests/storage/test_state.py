"""Algorithm state as a value: encode/decode round-trips any allowed value exactly, through a
real checkpoint file, and never shares memory with the algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.errors import UserError
from stocfl.storage import checkpoint, state
from stocfl.storage.store import ClientStore

plain = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False, width=64), st.text(max_size=5)
)
shapes = st.lists(st.integers(0, 3), min_size=0, max_size=2)


@st.composite
def tensors(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int64]))
    n = int(np.prod(shape)) if shape else 1
    vals = draw(st.lists(st.integers(-1000, 1000), min_size=n, max_size=n))
    return torch.tensor(vals, dtype=torch.float64).reshape(shape).to(dtype) / (3 if dtype.is_floating_point else 1)


arrays = tensors().map(lambda t: t.numpy().copy())
leaves = st.one_of(plain, tensors(), arrays)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.one_of(st.integers(-5, 5), st.text(max_size=3)), inner, max_size=3),
    ),
    max_leaves=8,
)


@dataclass
class S:
    a: Any
    b: Any


def same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, np.ndarray):
        return isinstance(y, np.ndarray) and x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(same(p, q) for p, q in zip(x, y))
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(same(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


@pytest.mark.long
@settings(max_examples=150, deadline=None)
@given(values, values)
def test_encode_decode_round_trips_through_a_checkpoint_file(tmp_path_factory, a, b):
    value = S(a, b)
    t, meta = state.encode(value)
    path = tmp_path_factory.mktemp("s") / "c.safetensors"
    checkpoint.save(path, t, meta)
    t2, m2 = checkpoint.load(path)
    back = state.decode(t2, m2, S(None, None))
    assert same(value.a, back.a) and same(value.b, back.b)


def test_an_encoded_state_shares_no_memory_with_the_value():
    w, labels = torch.zeros(3), np.zeros(2, dtype=np.int64)
    value = S({0: w, 1: w + 1}, labels)
    t, meta = state.encode(value)
    w += 5
    labels[0] = 7
    back = state.decode(t, meta, value)
    assert torch.equal(back.a[0], torch.zeros(3)) and back.b[0] == 0
    back.a[1] += 1  # the decoded value is a copy too: decoding again gives the saved numbers
    assert torch.equal(state.decode(t, meta, value).a[1], torch.ones(3))


@pytest.mark.parametrize("ram", [0, 2**20])
def test_a_component_loads_its_part_in_place(ram, tmp_path):
    store = ClientStore(4, 3, tmp_path, "rows", ram)
    value = S(store, 1)
    store.write({2: torch.ones(3)})
    t, meta = state.encode(value)
    store.write({2: torch.full((3,), 9.0), 3: torch.ones(3)})  # after the checkpoint: undone on load
    back = state.decode(t, meta, value)
    assert back.a is store and 2 in store and 3 not in store and torch.equal(store.get(2), torch.ones(3))


def test_what_cannot_be_checkpointed_is_named():
    with pytest.raises(state.StateError, match="field a/0: a set cannot"):
        state.encode(S([{1, 2}], 0))
    with pytest.raises(state.StateError, match="dict key"):
        state.encode(S({(1, 2): 0}, 0))
    t, meta = state.encode(S(1, 2))
    with pytest.raises(state.StateError, match="another version"):
        state.decode(t, {**meta, "format": 1}, S(0, 0))


def test_a_field_added_later_with_a_default_loads_from_an_older_checkpoint_and_one_without_is_refused():
    @dataclass
    class Later:
        a: Any
        b: Any
        c: dict = field(default_factory=dict)

    t, meta = state.encode(S(torch.ones(2), 3))  # written before c existed
    back = state.decode(t, meta, Later(None, None, {5: 1}))
    assert torch.equal(back.a, torch.ones(2)) and back.b == 3 and back.c == {5: 1}  # c: the starting value

    @dataclass
    class Required:
        a: Any
        b: Any
        c: Any

    with pytest.raises(state.StateError, match="field 'c' is missing"):
        state.decode(t, meta, Required(None, None, None))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, 5),
    st.integers(1, 40),
    st.dictionaries(st.text(max_size=4), plain, max_size=3),
    st.integers(0, 2**32 - 1),
)
def test_rows_written_one_at_a_time_load_as_the_plain_checkpoint_of_them(tmp_path_factory, n, p, meta, seed):
    # the reference: checkpoint.save of the whole (n, p) tensor; the streamed file must load to the
    # same rows and state and pass the same checksum (so that a flipped byte is still an error)
    rows = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, p)).astype(np.float32))
    d = tmp_path_factory.mktemp("rows")
    checkpoint.save(d / "plain.safetensors", {"rows": rows}, meta)
    checkpoint.save_rows(d / "streamed.safetensors", "rows", (r.numpy() for r in rows), n, p, meta)
    want, want_meta = checkpoint.load(d / "plain.safetensors")
    got, got_meta = checkpoint.load(d / "streamed.safetensors")
    assert got_meta == want_meta == meta
    assert got.keys() == want.keys() and torch.equal(got["rows"], want["rows"])
    if n:
        raw = bytearray((d / "streamed.safetensors").read_bytes())
        raw[-1] ^= 1
        (d / "streamed.safetensors").write_bytes(bytes(raw))
        with pytest.raises(UserError, match="corrupt"):
            checkpoint.load(d / "streamed.safetensors")


def test_writing_rows_refuses_a_count_or_width_it_was_not_told(tmp_path):
    with pytest.raises(ValueError, match="expected 3"):
        checkpoint.save_rows(tmp_path / "a", "rows", [np.zeros(2, np.float32)], 1, 3, {})
    with pytest.raises(ValueError, match="2 rows, expected 1"):
        checkpoint.save_rows(tmp_path / "a", "rows", [np.zeros(3, np.float32)] * 2, 1, 3, {})
    assert not list(tmp_path.iterdir())  # nothing left behind, not even the temporary file


CHECKPOINT_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@st.composite
def checkpoint_tensors(draw):
    names = draw(st.lists(st.text(min_size=1, max_size=6), max_size=6, unique=True))
    out = {}
    for k, name in enumerate(names):
        dtype = draw(st.sampled_from(CHECKPOINT_DTYPES))
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
        t = (torch.randn(tuple(shape), generator=g) * 100).to(dtype)
        if t.dim() == 2 and draw(st.booleans()):
            t = t.T  # a view with strides of its own: written as its contiguous copy
        out[name] = t
    return out


@settings(max_examples=60, deadline=None)
@given(checkpoint_tensors(), st.dictionaries(st.text(max_size=4), plain, max_size=3))
def test_a_checkpoint_written_a_tensor_at_a_time_is_the_librarys_file(tmp_path_factory, tensors, meta):
    """The reference: safetensors' own writer, which builds the whole file in memory. The same
    metadata and, per tensor, the same dtype, shape and bytes (the library orders the header's
    keys and the tensors of one element size as its own types do); every tensor's bytes start
    at a multiple of its element size, as the library's do."""
    import json
    import struct

    from safetensors.torch import save as to_bytes

    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

    def parts(raw: bytes):
        (n,) = struct.unpack("<Q", raw[:8])
        head, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
        assert n % 8 == 0 and sum(
            e[1] - e[0] for e in (v["data_offsets"] for k, v in head.items() if k != "__metadata__")
        ) == len(data)
        out = {}
        for k, v in head.items():
            if k != "__metadata__":
                a, b = v["data_offsets"]
                assert a % sizes[v["dtype"]] == 0
                out[k] = (v["dtype"], v["shape"], data[a:b])
        return head["__metadata__"], out

    path = tmp_path_factory.mktemp("ckpt") / "c.safetensors"
    checkpoint.save(path, tensors, meta)
    meta_json = json.dumps(meta)
    plain = {k: v.contiguous() for k, v in tensors.items()}
    want = to_bytes(plain, metadata={"stocfl": meta_json, "sha256": checkpoint.digest(plain, meta_json)})
    assert parts(path.read_bytes()) == parts(want)
    got, got_meta = checkpoint.load(path)
    assert got_meta == meta and got.keys() == tensors.keys()
    assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in tensors.items())


def test_a_checkpoint_is_written_without_a_copy_of_its_tensors_in_memory(tmp_path):
    """A StoCFL state with a model-sized Psi holds gigabytes; the file (and its checksum) used to
    be built in memory first, three times the state's memory at the end of every round."""
    import tracemalloc

    big = {"sums": torch.randn(64, 1 << 16, dtype=torch.float64), "theta": torch.randn(64, 1 << 16)}  # 48 MiB
    tracemalloc.start()
    try:
        checkpoint.save(tmp_path / "c.safetensors", big, {"round": 1})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"saving held {peak / 2**20:.1f} MiB of Python memory"
    got, _ = checkpoint.load(tmp_path / "c.safetensors")
    assert all(torch.equal(got[k], v) for k, v in big.items())
