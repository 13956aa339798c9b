"""The per-client store against the obvious reference (a dict of rows per client), in each of
its forms: in memory with a journal (within ``run.store_ram``), a mapped file with an undo log
(beyond it), and without a run directory. Generated sequences of writes, checkpoints, restores
in the same process, and kills (with or without a record cut short) followed by a reopening
from disk must always read back the reference's rows."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stocfl.errors import UserError
from stocfl.storage.store import RAM, ClientStore

FORMS = {"ram": RAM, "disk": 0}


def _same(store: ClientStore, ref: dict[int, torch.Tensor]) -> None:
    assert sorted(np.flatnonzero(store.has).tolist()) == sorted(ref)
    for i, row in ref.items():
        assert torch.equal(store.get(i), row), f"client {i}"


step = st.one_of(
    st.tuples(st.just("write"), st.lists(st.integers(0, 5), min_size=0, max_size=6, unique=True), st.integers(0, 99)),
    st.tuples(st.just("checkpoint")),
    st.tuples(st.just("restore")),
    st.tuples(st.just("kill"), st.booleans()),
)


@pytest.mark.parametrize("form", FORMS)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, max_size=25), p=st.integers(1, 40))
# a row written twice between checkpoints (a round that asks its clients twice), then a kill: the
# undo log once kept only the second write's old rows
@example(steps=[("write", [0], 1), ("checkpoint",), ("write", [0], 2), ("write", [0], 3), ("kill", False)], p=2)
def test_the_store_reads_back_the_checkpoint_it_was_restored_to(form, steps, p, tmp_path_factory):
    d = tmp_path_factory.mktemp("store")
    n = 6
    store = ClientStore(n, p, d, "s", FORMS[form])
    assert store.in_ram == (form == "ram")
    ref: dict[int, torch.Tensor] = {}
    saved = store.state()
    at_saved: dict[int, torch.Tensor] = {}
    for op in steps:
        if op[0] == "write":
            rows = {i: torch.arange(p, dtype=torch.float32) * (op[2] + 1) + i for i in op[1]}
            store.write(rows)
            ref.update({i: r.clone() for i, r in rows.items()})
        elif op[0] == "checkpoint":
            saved, at_saved = store.state(), dict(ref)
        elif op[0] == "restore":  # a round that failed: replayed from the last checkpoint
            store.load_state(*saved)
            ref = dict(at_saved)
        else:  # killed after the last checkpoint (mid-append, maybe), reopened by a new process
            if op[1] and store.journal is not None and store.journal.exists():
                with open(store.journal, "ab") as f:
                    f.write(b"STOCFLJ1\x40\x00")  # a record cut short
            store = ClientStore(n, p, d, "s", FORMS[form])
            store.load_state(*saved)
            ref = dict(at_saved)
        _same(store, ref)


def test_a_store_keeps_the_form_it_was_written_in(tmp_path):
    big = ClientStore(4, 3, tmp_path, "a", ram=0)  # beyond the budget: a mapped file
    big.write({1: torch.ones(3)})
    small = ClientStore(4, 3, tmp_path, "b")  # within it: memory and a journal
    small.write({2: torch.ones(3)})
    assert (tmp_path / "a.f32").exists() and not (tmp_path / "a.journal").exists()
    assert (tmp_path / "b.journal").exists() and not (tmp_path / "b.f32").exists()
    # reopened with the other budget, each keeps its form
    assert not ClientStore(4, 3, tmp_path, "a", ram=RAM).in_ram and ClientStore(4, 3, tmp_path, "b", ram=0).in_ram


def test_the_journal_is_folded_into_a_snapshot_only_at_a_checkpointed_version(tmp_path):
    s = ClientStore(3, 2, tmp_path, "s")
    for k in range(6):
        s.write({k % 3: torch.full((2,), float(k))})  # each record outgrows the 24-byte store
    assert not (tmp_path / "s.snapshot.safetensors").exists(), "no checkpoint yet: nothing may be folded"
    saved = s.state()
    s.write({0: torch.full((2,), 9.0)})
    assert (tmp_path / "s.snapshot.safetensors").exists()
    size = os.path.getsize(tmp_path / "s.journal")
    assert size < 100, "the journal starts again after its snapshot"
    again = ClientStore(3, 2, tmp_path, "s")
    again.load_state(*saved)
    assert torch.equal(again.get(0), torch.full((2,), 3.0)) and torch.equal(again.get(2), torch.full((2,), 5.0))


@pytest.mark.parametrize("damage", ["missing", "a version short", "another run's snapshot"])
def test_a_journal_that_cannot_give_the_checkpoint_is_refused_in_one_line(damage, tmp_path):
    s = ClientStore(3, 2, tmp_path, "s")
    s.write({0: torch.ones(2)})
    s.write({1: torch.ones(2)})
    saved = s.state()
    journal = tmp_path / "s.journal"
    if damage == "missing":
        journal.unlink()
    elif damage == "a version short":
        data = journal.read_bytes()
        journal.write_bytes(data[: data.rindex(b"STOCFLJ1")])
    else:
        other = ClientStore(3, 2, tmp_path / "o", "s")
        for k in range(4):
            other.write({k % 3: torch.ones(2)})
            other.state()
        other.write({0: torch.ones(2)})  # folds at version 4
        (tmp_path / "o" / "s.snapshot.safetensors").rename(tmp_path / "s.snapshot.safetensors")
    with pytest.raises(UserError) as err:
        ClientStore(3, 2, tmp_path, "s").load_state(*saved)
    assert "\n" not in str(err.value) and "cannot resume" in str(err.value)
