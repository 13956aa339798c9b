"""The batched engines' reused chunk memory against fresh tensors: the same replies to the bit,
and a reply that is kept (an algorithm's stored model) is never written by a later chunk."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.client.models import make_model
from stocfl.client.tasks import Train, task_seed
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor
from stocfl.executors.pool import RowPool

FED = build("dirichlet", load_dataset("digits"), 12, 30, alpha=0.5, seed=0)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)


def _tasks(clients: list[int], call: int, batch: int, prox: bool) -> list[Train]:
    center, local = W0 + 0.01 * call, LocalTraining.sgd(2, batch, 0.1)
    return [
        Train(i, W0 + 0.001 * (i + call), local, task_seed(call, 1, i), center if prox else None, 0.3) for i in clients
    ]


@settings(max_examples=25, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.lists(st.integers(0, FED.n_clients - 1), min_size=1, max_size=8),  # the clients of a call
            st.sampled_from([0, 7]),  # batch size
            st.booleans(),  # a proximal center
            st.lists(st.booleans(), min_size=8, max_size=8),  # which replies the caller keeps
        ),
        min_size=1,
        max_size=5,
    ),
    chunk=st.sampled_from([1, 3, 0]),
    lowrank=st.booleans(),
)
def test_pooled_chunks_give_the_fresh_tensors_replies_and_never_overwrite_a_kept_one(calls, chunk, lowrank):
    pooled = BatchedExecutor(FED, MODEL, chunk_size=chunk, lowrank=lowrank)
    fresh = BatchedExecutor(FED, MODEL, chunk_size=chunk, lowrank=lowrank)
    fresh.pool.enabled = False
    kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (a kept reply, its values when returned)
    for n, (clients, batch, prox, keep) in enumerate(calls):
        got = pooled.execute(_tasks(clients, n, batch, prox))
        want = fresh.execute(_tasks(clients, n, batch, prox))
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a.weights, b.weights)
            if keep[k]:
                kept.append((a.weights, a.weights.clone()))
        del got, want
        for w, values in kept:
            assert torch.equal(w, values), "a later chunk wrote into a reply that was kept"


def test_a_chunk_reuses_the_memory_of_replies_no_one_holds():
    ex = BatchedExecutor(FED, MODEL, chunk_size=4, lowrank=True)
    tasks = _tasks(list(range(8)), 0, 0, False)

    def memory(replies):
        return {r.weights.untyped_storage().data_ptr() for r in replies}

    first = memory(ex.execute(tasks))  # replies dropped at once
    assert memory(ex.execute(tasks)) == first and ex.pool.reused == 2, "the second call in the first's memory"
    held = ex.execute(tasks)
    views = [r.weights.view(-1, 1) for r in held]  # another view of a reply keeps its memory too
    del held
    assert memory(ex.execute(tasks)).isdisjoint(first), "memory a reply still holds is not handed out"
    del views
    assert memory(ex.execute(tasks)) & first, "and is once nothing holds it"


def test_the_pool_keeps_no_more_than_its_budget():
    pool = RowPool(budget=10 * 4 * 100)
    taken = [pool.take(4, 100, torch.float32, torch.device("cpu")) for _ in range(5)]
    assert sum(b.numel() * 4 for b in pool.buffers) <= 10 * 4 * 100 + 4 * 4 * 100  # the newest always kept
    assert all(t.shape == (4, 100) for t in taken)


def test_a_run_gives_its_kept_chunks_back_when_it_stops(tmp_path):
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    cfg = configure.load(
        None,
        overrides=["run.engine=lowrank", "run.rounds=2", "scenario.n_clients=6", "scenario.samples_per_client=20"],
    )
    exp = Experiment.create(cfg, tmp_path / "run")
    kept, release = [], exp.executor.release
    exp.executor.release = lambda: kept.append(len(exp.executor.pool.buffers)) or release()
    exp.run(progress=False)
    assert kept and kept[0] > 0, "the run's chunks were kept between its rounds"
    assert exp.executor.pool.buffers == []
    exp.executor.execute(_tasks([0, 1], 0, 0, False))  # and it still trains


# The run's allocator setting: memory freed inside a run is kept for the run's next tensors
# (no fresh pages a step), given back when the run ends, and no number changes.
_RSS = """
import os, sys, torch
from stocfl.executors.pool import keep_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

def churn():  # a model-sized temporary, written and freed
    t = torch.ones(64 << 20)  # 256 MB
    del t
    return rss()

base = rss()
outside = churn() - base
with keep_freed_memory() as kept:
    with keep_freed_memory():  # an inner run ending does not end the outer one's setting
        pass
    inside = churn() - base
after = rss() - base
print(kept, outside, inside, after)
"""


def _rss_deltas(env: dict[str, str]) -> tuple[bool, int, int, int]:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _RSS], capture_output=True, text=True, env=os.environ | env, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1]), int(out[2]), int(out[3])


def test_memory_freed_in_a_run_is_kept_for_its_next_tensors_and_given_back_at_its_end():
    from stocfl.executors.pool import _glibc

    if _glibc() is None:
        import pytest

        pytest.skip("the allocator setting is glibc's")
    kept, outside, inside, after = _rss_deltas({"STOCFL_KEEP_FREED_MEMORY": "1"})
    assert kept
    assert outside < 64, f"outside a run a freed 256 MB tensor goes back at once ({outside} MB held)"
    assert inside > 200, f"inside, it is kept for the next tensor ({inside} MB held)"
    assert after < 64, f"and given back when the run ends ({after} MB held)"
    kept, _, inside, _ = _rss_deltas({"STOCFL_KEEP_FREED_MEMORY": "0"})
    assert not kept and inside < 64, "STOCFL_KEEP_FREED_MEMORY=0 turns it off"


_SHORT = """
import os, torch
from stocfl.executors.pool import give_back_when_short, keep_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

base = rss()
with keep_freed_memory():
    t = torch.ones(64 << 20)  # 256 MB, freed into the heap and kept there
    del t
    held = rss() - base
    roomy = give_back_when_short(share=0.0)  # the system has room (more than the heap holds free)
    kept = rss() - base
    short = give_back_when_short(share=2.0)  # under twice the machine's memory: short by any measure
    given = rss() - base
print(held, roomy, kept, short, given, give_back_when_short(share=2.0))
"""


def test_a_run_gives_its_kept_memory_back_when_the_system_runs_short():
    """The heap keeps freed memory for the next round while the system has room, and hands it
    back when the system runs short; outside a run there is nothing kept to give."""
    import os
    import subprocess
    import sys

    from stocfl.executors.pool import _glibc

    if _glibc() is None:
        pytest.skip("the allocator setting is glibc's")
    out = subprocess.run(
        [sys.executable, "-c", _SHORT], capture_output=True, text=True, env=os.environ, check=True
    ).stdout.split()
    held, roomy, kept, short, given, outside = int(out[0]), out[1], int(out[2]), out[3], int(out[4]), out[5]
    assert held > 200, f"the freed tensor is kept inside a run ({held} MB held)"
    assert roomy == "False" and kept > 200, f"with room, it stays kept ({kept} MB held)"
    assert short == "True" and given < 64, f"short, it goes back to the system ({given} MB held)"
    assert outside == "False"


def test_what_counts_as_short_is_the_systems_memory_left_against_its_share(monkeypatch):
    from stocfl.executors import pool

    if pool._glibc() is None:
        pytest.skip("the allocator setting is glibc's")
    with pool.keep_freed_memory():
        monkeypatch.setattr(pool, "_system_memory", lambda: (16 << 30, 4 << 30))  # a quarter left: room
        assert not pool.give_back_when_short()
        assert pool.give_back_when_short(share=0.5)  # under half left: short
        monkeypatch.setattr(pool, "_system_memory", lambda: (16 << 30, 1 << 30))  # a sixteenth left
        assert pool.give_back_when_short()
        monkeypatch.setattr(pool, "_system_memory", lambda: None)  # a system that does not say
        assert not pool.give_back_when_short(share=2.0)


def test_every_round_of_a_run_asks_whether_the_system_needs_the_memory_kept(tmp_path, monkeypatch):
    import stocfl
    from stocfl.experiment import loop

    calls: list[int] = []
    monkeypatch.setattr(loop, "give_back_when_short", lambda: calls.append(1) or False)
    cfg = stocfl.load_config(
        None, ["run.rounds=3", "scenario.n_clients=6", "algorithm.name=fedavg", "run.eval_every=3"]
    )
    stocfl.run(cfg, out=tmp_path / "run", progress=False)
    assert len(calls) == 3


def test_keeping_freed_memory_changes_no_number(tmp_path, monkeypatch):
    import json

    import stocfl

    def rows(name: str) -> list[dict]:
        cfg = stocfl.load_config(
            None, ["run.engine=batched", "run.rounds=3", "run.eval_every=1", "algorithm.name=stocfl"]
        )
        stocfl.run(cfg, out=tmp_path / name, progress=False)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "seconds"} for line in lines]

    monkeypatch.setenv("STOCFL_KEEP_FREED_MEMORY", "0")
    plain = rows("plain")
    monkeypatch.setenv("STOCFL_KEEP_FREED_MEMORY", "1")
    assert rows("kept") == plain


def test_a_runs_rounds_run_with_freed_memory_kept_and_give_it_back_after(tmp_path):
    from stocfl.executors import pool
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    if pool._glibc() is None:
        import pytest

        pytest.skip("the allocator setting is glibc's")
    cfg = configure.load(None, overrides=["run.engine=batched", "run.rounds=2", "scenario.n_clients=6"])
    exp = Experiment.create(cfg, tmp_path / "run")
    seen, ask = [], exp.ask
    exp.ask = lambda tasks: seen.append(pool._kept) or ask(tasks)
    exp.run(progress=False)
    assert seen and all(k == 1 for k in seen), "every task of the run ran inside the block"
    assert pool._kept == 0, "and the run ended it"


# A round whose replies cannot fit in memory is refused before any work, in one line: the system
# would otherwise kill the process partway through it (stocfl-table1-2400x100-100pct: 4,800
# replies of 6.5 MB on a 24 GB machine).
def test_a_round_whose_replies_do_not_fit_in_memory_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    from stocfl.cli import main
    from stocfl.executors import base

    trained = []
    train = BatchedExecutor.train
    monkeypatch.setattr(BatchedExecutor, "train", lambda self, *a: trained.append(1) or train(self, *a))
    argv = ["run", "--set", "run.rounds=1", "--set", "run.sample_rate=1.0", "--set", "scenario.n_clients=5"]
    argv += ["--set", "algorithm.name=fedavg", "--engine", "batched"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0 and trained  # room enough: it runs
    trained.clear()
    capsys.readouterr()
    monkeypatch.setattr(
        base, "available_bytes", lambda at_least=0: MODEL.n_params * 4 * 5 - 1
    )  # less room than 5 models
    assert main([*argv, "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "5 client trainings return" in err[0] and "run.sample_rate" in err[0], err
    assert trained == []  # refused before any client trained


def test_a_pools_free_memory_counts_as_room_for_the_next_replies(monkeypatch):
    from stocfl.errors import UserError
    from stocfl.executors import base

    ex = BatchedExecutor(FED, MODEL)
    ex.execute(_tasks([0, 1, 2, 3, 4], 0, 0, False))  # replies dropped: their chunk is free in the pool
    monkeypatch.setattr(base, "available_bytes", lambda at_least=0: 0)
    assert ex.reusable_bytes() >= ex.reply_bytes(_tasks([0, 1, 2, 3, 4], 1, 0, False)) > 0
    assert len(ex.execute(_tasks([0, 1, 2, 3, 4], 1, 0, False))) == 5
    ex.release()
    with pytest.raises(UserError, match="5 client trainings return"):
        ex.execute(_tasks([0, 1, 2, 3, 4], 2, 0, False))


def test_memory_freed_inside_a_run_counts_as_the_process_s_own():
    from stocfl.executors.pool import available_bytes, heap_free_bytes, keep_freed_memory

    assert (available_bytes() or 0) > 0
    with keep_freed_memory() as kept:
        before = heap_free_bytes()
        t = torch.ones(32 << 20)  # 128 MB, from the heap inside a run
        del t  # freed into the heap, kept there for the run's next tensors
        if kept:
            assert heap_free_bytes() - before >= 120 << 20


def test_the_heap_is_asked_only_where_the_systems_free_memory_falls_short(monkeypatch):
    from stocfl.executors import pool

    monkeypatch.setattr(pool, "heap_free_bytes", lambda: 1 << 60)  # walking the heap: milliseconds
    system = pool.available_bytes()
    assert system is not None and system < 1 << 60  # enough for no call: the heap not asked
    assert (pool.available_bytes(at_least=1 << 59) or 0) >= 1 << 60  # more than the system has: the heap counted


def test_the_flower_engine_refuses_a_round_that_cannot_fit_before_it_sends_a_task(monkeypatch):
    """The server of a Flower run receives every reply too: the same one line, before any message."""
    from stocfl.errors import UserError
    from stocfl.executors import base
    from stocfl.flower.engine import FlowerExecutor

    monkeypatch.setattr(base, "available_bytes", lambda at_least=0: 0)
    executor = FlowerExecutor(grid=None)  # type: ignore[arg-type]  # no grid: a message sent would fail otherwise
    with pytest.raises(UserError, match="3 client trainings return"):
        executor.execute(_tasks([0, 1, 2], 0, 0, False))
    assert base.reply_bytes(_tasks([0, 1, 2], 0, 0, False)) == 3 * W0.numel() * 4
