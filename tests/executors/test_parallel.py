"""The parallel executor (client tasks in forked worker processes, one torch thread each)
against the plain sequential loop at one thread, and its failures told in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stocfl.client.models import FlatModel, make_model
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import KINDS, Train, register_task
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.errors import UserError
from stocfl.executors import ParallelExecutor, SequentialExecutor, make_executor
from stocfl.experiment import configure

FED = build("rotated", load_dataset("digits"), 12, 20, seed=0)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
PARALLEL = ParallelExecutor(FED, MODEL, workers=2)
SEQUENTIAL = SequentialExecutor(FED, MODEL)


@pytest.fixture(autouse=True)
def one_thread():
    """The reference runs at one torch thread, as each worker does: then the numbers are equal bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


train_tasks = st.lists(
    st.tuples(
        st.integers(0, FED.n_clients - 1),  # client
        st.integers(0, 3),  # which weights: w0 or a row of a stacked matrix (a view into a larger storage)
        st.integers(1, 2),  # epochs
        st.sampled_from([0, 3, 7, 20]),  # batch size (0 = full batch)
        st.sampled_from([0.01, 0.1, 0.5]),  # lr
        st.integers(0, 2**31 - 1),  # seed
        st.sampled_from([0.0, 0.1]),  # proximal weight (its center: another row)
        st.sampled_from(["sgd", "adam"]),
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=40, deadline=None)
@given(train_tasks)
def test_the_parallel_executor_equals_the_sequential_loop(specs):
    rows = W0 + 0.01 * torch.randn(3, len(W0), generator=torch.Generator().manual_seed(len(specs)))
    tasks = [
        Train(
            c,
            W0 if k == 0 else rows[k - 1],
            LocalTraining(e, b, Optimizer(opt, lr, momentum=0.5 if opt == "sgd" else 0.0)),
            seed,
            prox_center=rows[(k + 1) % 3] if mu else None,
            prox_weight=mu,
        )
        for c, k, e, b, lr, seed, mu, opt in specs
    ]
    got, want = PARALLEL.execute(tasks), SEQUENTIAL.execute(tasks)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.n_samples == w.n_samples
        assert torch.equal(g.weights, w.weights)
    # the rows went to the workers as copies of their own, not as the whole stacked storage
    assert rows.untyped_storage().data_ptr() == rows.data_ptr() and not rows.is_shared()


@dataclass(frozen=True, eq=False)
class WhereAmI:
    client: int
    die: bool = False


@dataclass(frozen=True, eq=False)
class Here:
    pid: int
    threads: int


def _where(data, task):
    if task.die:
        os.kill(os.getpid(), signal.SIGKILL)
    return Here(os.getpid(), torch.get_num_threads())


def test_tasks_run_in_worker_processes_on_one_thread_each_and_a_kind_registered_later_reaches_them():
    ex = ParallelExecutor(FED, MODEL, workers=2)
    ex.execute([Train(c, W0, LocalTraining.sgd(1, 0, 0.1), c) for c in range(4)])  # forks the workers
    KINDS.pop(WhereAmI, None)
    register_task(WhereAmI, Here, _where, message="query.whereami")
    try:
        got = ex.execute([WhereAmI(c) for c in range(8)])
        pids = {h.pid for h in got}
        assert os.getpid() not in pids and 1 <= len(pids) <= 2
        assert {h.threads for h in got} == {1}
        KINDS.pop(WhereAmI)  # the same kind registered again with another function reaches them too
        register_task(WhereAmI, Here, lambda data, task: Here(-task.client, 0), message="query.whereami")
        assert [h.pid for h in ex.execute([WhereAmI(c) for c in range(1, 4)])] == [-1, -2, -3]
    finally:
        KINDS.pop(WhereAmI, None)
        ex.close()


def test_the_tasks_tensors_go_into_shared_memory_on_the_calling_thread(monkeypatch):
    """Pickling a task moves its tensors into shared memory, a copy that torch runs on a team of
    threads of the thread that makes it. Left to the pool's feeder thread, it started a second
    OpenMP team in the parent, and the runtime then stopped spinning between parallel regions:
    the parent's replies' checks and mean ran 2-3x slower for as long as the workers lived."""
    real = torch.UntypedStorage._share_fd_cpu_
    on_main: list[bool] = []

    def recording(self, *args, **kwargs):
        on_main.append(threading.current_thread() is threading.main_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "_share_fd_cpu_", recording)
    ex = ParallelExecutor(FED, MODEL, workers=2)
    try:
        stacked = torch.stack([W0 + k for k in range(3)])  # rows: views, compacted then shared
        tasks = [Train(c, stacked[c % 3] if c % 2 else W0.clone(), LocalTraining.sgd(1, 0, 0.1), c) for c in range(6)]
        got = ex.execute(tasks)
        want = [SEQUENTIAL.execute([t])[0] for t in tasks]
        assert all(torch.equal(g.weights, w.weights) for g, w in zip(got, want))
        assert on_main and all(on_main)
    finally:
        ex.close()


def test_a_worker_that_dies_is_one_line_and_the_executor_forks_anew():
    ex = ParallelExecutor(FED, MODEL, workers=2)
    KINDS.pop(WhereAmI, None)
    register_task(WhereAmI, Here, _where, message="query.whereami")
    try:
        with pytest.raises(UserError, match="a worker process died"):
            ex.execute([WhereAmI(0), WhereAmI(1, die=True), WhereAmI(2)])
        assert len(ex.execute([WhereAmI(c) for c in range(3)])) == 3
    finally:
        KINDS.pop(WhereAmI, None)
        ex.close()


def test_bad_arguments_are_one_line():
    with pytest.raises(UserError, match="runs on the CPU"):
        ParallelExecutor(FED, MODEL, workers=2, device="meta")
    with pytest.raises(UserError, match="workers must be"):
        ParallelExecutor(FED, MODEL, workers=0)


def test_auto_runs_whole_clients_side_by_side_when_it_has_threads_for_them():
    module = nn.Sequential(nn.Flatten(), nn.Linear(64, 8192), nn.ReLU(), nn.Linear(8192, 10))
    model = FlatModel(module)  # compute-bound per step: sequential work, not batched; momentum: not low-rank
    cfg = configure.validate({"train": {"batch_size": 20, "momentum": 0.9}, "run": {"device": "cpu"}})
    torch.set_num_threads(2)
    assert make_executor("auto", FED, model, cfg).name == "parallel"
    torch.set_num_threads(1)
    assert make_executor("auto", FED, model, cfg).name == "sequential"


@given(n=st.integers(0, 500), workers=st.integers(1, 16))
def test_guided_parts_cover_the_tasks_in_order_and_shrink(n, workers):
    from stocfl.executors.parallel import part_sizes

    sizes = part_sizes(n, workers)
    assert sum(sizes) == n and all(s >= 1 for s in sizes) and sizes == sorted(sizes, reverse=True)
    assert not sizes or sizes[0] == -(-n // (2 * workers))


@pytest.mark.long
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_the_workers_end_with_a_parent_that_is_killed():
    """A parent killed mid-run (SIGKILL, or SIGTERM's default) must not leave its workers
    waiting forever on a queue they hold both ends of."""
    script = (
        "from stocfl.data.datasets import load_dataset\n"
        "from stocfl.executors import ParallelExecutor\n"
        "from stocfl.client.models import make_model\n"
        "from stocfl.data.scenarios import build\n"
        "import time\n"
        "fed = build('rotated', load_dataset('digits'), 4, 20, seed=0)\n"
        "model, _ = make_model('auto', fed.input_shape, 10, 0, seed=0)\n"
        "executor = ParallelExecutor(fed, model, workers=2)\n"
        "pool = executor._workers()\n"
        "print(*pool._processes, flush=True)\n"
        "time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in workers)


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (a killed worker of the test's own child is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_run_on_parallel_has_the_numbers_of_sequential_at_one_thread_every_metric_included():
    """The docs' claim, exactly: with the server on one thread (run.threads = 1) and the tasks in
    two worker processes, every metric of every round equals the sequential loop's at one thread,
    StoCFL's objective included (a float sum the server reduces itself)."""
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    cfg = configure.load("default", ["run.threads=1", "run.engine=sequential", "run.rounds=14"])
    probe = Experiment(cfg, None)
    pool = ParallelExecutor(probe.fed, probe.model, workers=2)
    try:
        runs = {"sequential": Experiment.create(cfg, None), "parallel": Experiment.create(cfg, None, pool)}
        rows = {}
        for name, exp in runs.items():
            exp.run(progress=False)
            rows[name] = [{k: v for k, v in r.items() if k != "seconds"} for r in exp.rows]
    finally:
        pool.close()
    assert rows["parallel"] == rows["sequential"] and rows["sequential"][-1]["objective"] > 0


# Results through the workers' arenas (large tensors written into shared memory a worker keeps
# from call to call, copied out by the parent) against the same results computed here.


@dataclass(frozen=True, eq=False)
class Make:
    client: int
    seed: int
    sizes: tuple[int, ...]  # one tensor field per size (numel)
    dtype: str
    view: bool  # the large tensor as a strided view into a larger storage
    same: bool  # the second field the first one itself


@dataclass(frozen=True, eq=False)
class Made:
    a: torch.Tensor
    b: torch.Tensor
    c: torch.Tensor | None
    n: int


def _make(data, task):
    g = torch.Generator().manual_seed(task.seed)
    dtype = getattr(torch, task.dtype)

    def tensor(n):
        if task.view:  # every other entry of a larger tensor: not contiguous, offset
            full = (torch.randn(2 * n + 1, generator=g) * 100).to(dtype)
            return full[1::2]
        return (torch.randn(n, generator=g) * 100).to(dtype)

    a = tensor(task.sizes[0])
    b = a if task.same else tensor(task.sizes[1])
    c = tensor(task.sizes[2]) if len(task.sizes) > 2 else None
    return Made(a, b, c, task.client)


makes = st.lists(
    st.builds(
        Make,
        client=st.integers(0, FED.n_clients - 1),
        seed=st.integers(0, 2**31 - 1),
        sizes=st.lists(st.sampled_from([0, 1, 100, 16_383, 16_384, 40_000, 300_000]), min_size=2, max_size=3).map(
            tuple
        ),
        dtype=st.sampled_from(["float32", "float64", "int64", "uint8", "bool", "float16"]),
        view=st.booleans(),
        same=st.booleans(),
    ),
    min_size=2,
    max_size=12,
)


@pytest.fixture(scope="module")
def made_kind():
    KINDS.pop(Make, None)
    register_task(Make, Made, _make, message="query.make")
    executors = {cap: ParallelExecutor(FED, MODEL, workers=2) for cap in (1 << 30, 1 << 20, 0)}
    for cap, ex in executors.items():
        ex.arena_max = cap  # a large arena, one that some calls overflow, none
    yield executors
    KINDS.pop(Make, None)
    for ex in executors.values():
        ex.close()


@settings(max_examples=25, deadline=None)
@given(calls=st.lists(makes, min_size=1, max_size=3), cap=st.sampled_from([1 << 30, 1 << 20, 0]))
def test_results_through_the_arena_equal_the_results_made_here_and_a_later_call_leaves_them_be(made_kind, calls, cap):
    ex = made_kind[cap]
    kept = []  # every call's results, held while the later calls write the arenas again
    for tasks in calls:
        kept.append((tasks, ex.execute(tasks)))
    for tasks, got in kept:
        for t, r in zip(tasks, got):
            want = _make(None, t)
            assert r.n == want.n
            for name in ("a", "b", "c"):
                g, w = getattr(r, name), getattr(want, name)
                assert (g is None) == (w is None)
                if w is not None:
                    assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
            assert (r.a is r.b) == t.same or t.same and r.a.numel() == 0


def test_an_arena_grows_to_a_call_and_holds_the_next_one():
    from stocfl.executors.parallel import _Arena

    arena = _Arena(cap=1 << 26)
    x = torch.arange(1 << 18, dtype=torch.float32)  # 1 MB
    assert arena.put(x, call=0) is None  # none yet: the plain way, and room for the next call
    first = arena.put(x, call=1)
    assert first is not None and torch.equal(first, x) and first.is_shared()
    second = arena.put(x + 1, call=1)
    assert second is not None and torch.equal(first, x) and second.data_ptr() >= first.data_ptr() + (1 << 20)
    again = arena.put(x + 2, call=2)  # a new call writes from the start
    assert again is not None and again.data_ptr() == first.data_ptr()
    assert _Arena(cap=0).put(x, call=0) is None and _Arena(cap=0).put(x, call=1) is None


def test_an_arena_that_cannot_be_made_leaves_the_results_to_the_plain_way(monkeypatch):
    """/dev/shm without room for an arena: the worker stops asking for one, and every result
    still arrives, equal to the one made here."""
    real = torch.Tensor.share_memory_

    def refuse(self):
        if self.dtype == torch.uint8:  # the arena's buffer; results' storages are shared otherwise
            raise RuntimeError("unable to write to file </torch_1>: No space left on device (28)")
        return real(self)

    monkeypatch.setattr(torch.Tensor, "share_memory_", refuse)  # before the fork: the workers inherit it
    KINDS.pop(Make, None)
    register_task(Make, Made, _make, message="query.make")
    ex = ParallelExecutor(FED, MODEL, workers=2)
    try:
        tasks = [Make(c, c, (300_000, 40_000), "float32", False, False) for c in range(6)]
        for _ in range(3):  # the first call asks for room, the second is refused it, the third goes plain
            for t, r in zip(tasks, ex.execute(tasks)):
                want = _make(None, t)
                assert torch.equal(r.a, want.a) and torch.equal(r.b, want.b)
    finally:
        KINDS.pop(Make, None)
        ex.close()
