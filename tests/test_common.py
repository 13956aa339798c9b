"""The common suite: every algorithm on every executor (sequential, parallel, batched, and the loopback
executor that sends every task and result through the Flower codec and Flower's wire format),
with held-out clients, checkpoints through the real file format, new-client placement, a
single-client federation and rounds in which every sampled client fails."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.algorithms import ALGORITHMS, Context
from stocfl.algorithms.aggregation import Aggregator
from stocfl.client.mixture import Mixture, MixtureTrain, evaluation_task
from stocfl.client.models import FlatModel, build_module, make_model
from stocfl.client.optim import Optimizer
from stocfl.client.split import SplitTrain
from stocfl.client.tasks import ClientsDropped, Train
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor, ParallelExecutor, SequentialExecutor
from stocfl.experiment import configure, metrics
from stocfl.experiment.loop import Experiment
from stocfl.flower.loopback import LoopbackExecutor
from stocfl.storage import checkpoint

FED = build("rotated", load_dataset("digits"), 16, 20, seed=0, holdout=0.25)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
MODULE = build_module("auto", FED.input_shape, 10, 0)
PARTICIPANTS = FED.participants
HELDOUT = FED.heldout_clients
# small settings under which every algorithm does its characteristic step within 3 rounds
PARAMS = {
    "flhc": {"warmup_rounds": 1},
    "fesem": {"n_centers": 2},
    "ifca": {"n_models": 2},
    "cfl": {"warmup": 0, "eps1": 100.0, "eps2": 0.0},
    "fedem": {"n_components": 2},
    "fedrc": {"n_clusters": 2},
    "fedsoft": {"n_clusters": 2},
    "pacfl": {"n_clusters": 2},
    "clove": {"max_models": 3},
    "flux": {"warmup_rounds": 1},
    "cflgp": {"n_models": 2, "period": 1},
    "fedccfa": {"align_after": 1, "balanced_epochs": 2},
    "srfca": {"init_epochs": 1, "refine_rounds": 1, "size_threshold": 0, "dist_fraction": 0.5},
    # a variant with a task kind of its own: NAME:VARIANT runs NAME with these parameters
    "cfl:gradients": {"warmup": 0, "eps1": 100.0, "eps2": 0.0, "similarity": "gradients"},
}
VARIANTS = [name for name in PARAMS if ":" in name]


def small_settings(name: str) -> list[str]:
    """``--set`` overrides that run algorithm ``name`` with its PARAMS."""
    return [f"algorithm.name={name}"] + [f"algorithm.{k}={json.dumps(v)}" for k, v in PARAMS.get(name, {}).items()]


SAMPLES = [PARTICIPANTS[0:6], PARTICIPANTS[3:9], PARTICIPANTS[6:12]]


def context(
    fed=FED, w0=W0, sample_size=6, workdir=None, aggregator=Aggregator(), local=LocalTraining.sgd(1, 10, 0.1)
) -> Context:
    return Context(
        fed.n_clients,
        w0,
        local=local,
        seed=0,
        input_shape=fed.input_shape,
        n_classes=fed.n_classes,
        init_model=lambda seed: FlatModel.init_weights(MODULE, seed),
        last_layer=MODEL.numels[-1] + MODEL.numels[-2],
        participants=tuple(fed.participants),
        sample_size=sample_size,
        workdir=workdir,
        aggregator=aggregator,
    )


class Recording:
    """Wraps an executor; records the client of every task it runs."""

    def __init__(self, inner):
        self.inner, self.fed, self.model = inner, inner.fed, inner.model
        self.clients: set[int] = set()

    def execute(self, tasks):
        self.clients |= {t.client for t in tasks}
        return self.inner.execute(tasks)


EXECUTORS = {
    "sequential": lambda fed=FED: SequentialExecutor(fed, MODEL),
    "parallel": lambda fed=FED: ParallelExecutor(fed, MODEL, workers=2),
    "batched": lambda fed=FED: BatchedExecutor(fed, MODEL),
    "lowrank": lambda fed=FED: BatchedExecutor(fed, MODEL, lowrank=True),
    "lowrank-factored": lambda fed=FED: BatchedExecutor(fed, MODEL, lowrank=True, factored=True),
    "loopback": lambda fed=FED: LoopbackExecutor(SequentialExecutor(fed, MODEL), nodes=3),
}


def make(name, **kw):
    cls = ALGORITHMS[name.partition(":")[0]]
    return cls(cls.Params(**PARAMS.get(name, {})), context(**kw))


def play(alg, executor, samples=SAMPLES, start=1):
    for t, s in enumerate(samples, start):
        alg.round(t, list(s), executor.execute)
    return alg


def is_a_model(m) -> bool:
    """Flat finite weights like w_0, or a Mixture of such models (FedEM's clients)."""
    if isinstance(m, Mixture):
        return (
            m.models.shape[1:] == W0.shape and bool(torch.isfinite(m.models).all()) and len(m.weights) == len(m.models)
        )
    return m.shape == W0.shape and bool(torch.isfinite(m).all())


def assert_same_state(a, b):
    (ta, ma), (tb, mb) = a.encode_state(), b.encode_state()
    assert set(ta) == set(tb) and ma == mb
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


_reference: dict[str, object] = {}


def sequential_reference(name):
    if name not in _reference:
        _reference[name] = play(make(name), SequentialExecutor(FED, MODEL))
    return _reference[name]


@pytest.fixture
def one_thread():
    """Every executor compared at one torch thread, as the parallel executor's workers run: a
    reduction split over more threads adds in another order (in a plain `pytest` on a machine
    of several cores; `make test` pins each xdist worker to one core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("name", [*ALGORITHMS, *VARIANTS])
def test_every_algorithm_on_every_executor(name, executor, tmp_path, one_thread):
    rec = Recording(EXECUTORS[executor]())
    alg = play(make(name), rec)
    # held-out clients never take part in training or clustering, and are not placed
    assert not rec.clients & set(HELDOUT), f"held-out clients {sorted(rec.clients & set(HELDOUT))} got tasks"
    labels = alg.cluster_labels()
    assert labels.shape == (FED.n_clients,) and (labels[HELDOUT] == -1).all()
    # the same numbers as the sequential reference (batched: to float rounding)
    ref = sequential_reference(name)
    assert np.array_equal(labels, ref.cluster_labels())
    assert torch.allclose(alg.global_model(), ref.global_model(), atol=1e-5)
    if executor not in ("batched", "lowrank", "lowrank-factored"):
        assert torch.equal(alg.global_model(), ref.global_model()), "the codec must carry numbers unchanged"
    # state through the checkpoint file (safetensors + JSON metadata) and back
    tensors, meta = alg.encode_state()
    checkpoint.save(tmp_path / "c.safetensors", tensors, meta)
    t2, m2 = checkpoint.load(tmp_path / "c.safetensors")
    fresh = make(name)
    fresh.decode_state(t2, m2)
    assert_same_state(alg, fresh)
    ex = EXECUTORS[executor]()
    nxt = [PARTICIPANTS[9:12] + PARTICIPANTS[0:2]]
    play(alg, ex, nxt, start=4)
    play(fresh, ex, nxt, start=4)
    assert_same_state(alg, fresh)
    # new clients (the held-out ones) are placed without changing the partition
    before = alg.cluster_labels()
    placed = alg.place_new(HELDOUT, ex.execute)
    assert [p.client for p in placed] == HELDOUT
    found = set(alg.cluster_labels()[alg.cluster_labels() >= 0].tolist())
    for p in placed:
        assert is_a_model(p.weights)
        assert p.cluster == -1 or p.cluster in found, (p.cluster, found)
    assert np.array_equal(alg.cluster_labels(), before)
    models = alg.client_models(PARTICIPANTS, ex.execute)
    assert len(models) == len(PARTICIPANTS) and all(is_a_model(m) for m in models)


@pytest.mark.parametrize("rule", ["clip", "median", "trimmed_mean"])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_combines_by_the_runs_rule(name, rule):
    """Each algorithm routes its models through the run's aggregation rule: with a robust rule
    the state differs from the mean's, stays finite, and equals itself on the codec path."""
    alg = play(make(name, aggregator=Aggregator(rule, trim=0.34)), SequentialExecutor(FED, MODEL))
    ref = sequential_reference(name)
    tensors, _ = alg.encode_state()
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    ref_tensors, _ = ref.encode_state()
    assert any(not torch.equal(t, ref_tensors[k]) for k, t in tensors.items()), f"{name} ignores aggregation.rule"
    again = play(make(name, aggregator=Aggregator(rule, trim=0.34)), EXECUTORS["loopback"]())
    assert_same_state(alg, again)


class Asked:
    """Wraps an executor; keeps every task it is asked to run."""

    def __init__(self, inner):
        self.inner, self.fed, self.model = inner, inner.fed, inner.model
        self.tasks: list = []

    def execute(self, tasks):
        self.tasks += tasks
        return self.inner.execute(tasks)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_training_task_carries_the_runs_optimizer(name):
    """A non-default [train] (momentum, weight decay, its own lr and batch size) reaches every
    Train task every algorithm asks for, through the Flower codec: only the epoch count of a
    step whose paper sets its own (FL+HC's clustering step) differs."""
    local = LocalTraining(2, 7, Optimizer("sgd", 0.05, momentum=0.9, weight_decay=1e-3))
    cls = ALGORITHMS[name]
    alg = cls(cls.Params(**PARAMS.get(name, {})), context(local=local))
    asked = Asked(EXECUTORS["loopback"]())
    play(alg, asked)
    trains = [t for t in asked.tasks if isinstance(t, (Train, MixtureTrain))]
    # FedCCFA's split step: [train] is its feature extractor's phase; its classifier phases
    # share the optimizer and batch size, with the epochs and rates its paper sets
    for t in [t for t in asked.tasks if isinstance(t, SplitTrain)]:
        assert t.body == local, (name, t.body)
        for phase in (t.head, t.balanced):
            assert phase.batch_size == local.batch_size and phase.optimizer.momentum == 0.9, (name, phase)
            assert phase.optimizer.weight_decay == 1e-3, (name, phase)
        trains.append(t)
    assert trains, f"{name} asked for no training"
    # a method's own count for one step: FL+HC's clustering step, SR-FCA's INIT
    own = {"flhc": "cluster_epochs", "srfca": "init_epochs"}.get(name)
    own = getattr(alg.params, own) if own else None
    for t in trains:
        if isinstance(t, SplitTrain):
            continue
        assert t.local.optimizer == local.optimizer and t.local.batch_size == local.batch_size, (name, t.local)
        assert t.local.epochs in {local.epochs, own}, (name, t.local)
    if name == "flhc":
        assert any(t.local.epochs == own for t in trains), "FL+HC's clustering step ran"
    plain = cls(cls.Params(**PARAMS.get(name, {})), context(local=LocalTraining.sgd(2, 7, 0.05)))
    play(plain, SequentialExecutor(FED, MODEL))
    ta, tb = alg.encode_state()[0], plain.encode_state()[0]
    assert any(not torch.equal(v, tb[k]) for k, v in ta.items()), f"{name}: the optimizer changed nothing"


SINGLE = {"fesem": {"n_centers": 1}, "flhc": {"warmup_rounds": 1}, "ifca": {"n_models": 2}}


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_single_client_federation(name):
    fed = build("iid", load_dataset("digits"), 1, 20, seed=0)
    ex = SequentialExecutor(fed, MODEL)
    cls = ALGORITHMS[name]
    alg = cls(cls.Params(**SINGLE.get(name, {})), context(fed, sample_size=1))
    play(alg, ex, [[0], [0], [0]])
    assert alg.cluster_labels().tolist() == [0] or alg.cluster_labels()[0] >= 0
    assert torch.isfinite(alg.global_model()).all()
    (res,) = ex.execute([evaluation_task(0, alg.client_models([0], ex.execute)[0])])
    assert 0 <= res.correct <= res.n_samples


class FailAll(SequentialExecutor):
    """The sequential executor, except that while ``failing`` is set no client answers."""

    failing = False

    def execute(self, tasks):
        if self.failing and tasks:
            clients = sorted({t.client for t in tasks})
            raise ClientsDropped(clients, [f"client {c}: no reply" for c in clients])
        return super().execute(tasks)


SMALL = [
    "scenario.n_clients=16",
    "scenario.samples_per_client=20",
    "run.rounds=4",
    "run.sample_rate=0.5",
    "scenario.holdout=0.25",
]
RUN_PARAMS = {"flhc": ["algorithm.warmup_rounds=1"], "fesem": ["algorithm.n_centers=2"]}


@pytest.mark.long  # a whole run an algorithm: make test, not make test-fast
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_a_round_in_which_every_sampled_client_fails_stops_the_run_and_resumes_as_if_it_had_not(tmp_path, name):
    """A round in which no client answers (its training, or its evaluation when an algorithm
    goes on without the clients it lost, as FL+HC's clustering step does) stops the run with
    one line naming why: nothing is counted as a round done with no client, accuracy null
    (issue 70, finding 7). The state is the last checkpoint's; resumed once the clients answer
    again, the run ends as one in which round 2 never failed."""
    from stocfl.errors import UserError

    cfg = configure.load(overrides=[*SMALL, f"algorithm.name={name}", *RUN_PARAMS.get(name, [])])
    probe = Experiment(cfg, tmp_path / "probe")
    ex = FailAll(probe.fed, probe.model)
    exp = Experiment.create(cfg, tmp_path / name, ex)
    assert exp.run(progress=False, stop_after=1) is None
    before = exp.algorithm.encode_state()
    ex.failing = True
    with pytest.raises(UserError) as err:
        exp.run(progress=False, stop_after=2)
    said = str(err.value)
    assert "\n" not in said and said.startswith("round 2: "), said
    assert "every client" in said and "no reply" in said and f"stocfl resume {tmp_path / name}" in said, said
    after = exp.algorithm.encode_state()
    assert set(before[0]) == set(after[0]) and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    ex.failing = False
    summary = Experiment.resume(tmp_path / name, executor=ex).run(progress=False)
    rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4] and summary["rounds_done"] == 4
    assert all(r["dropped"] == 0 for r in rows) and summary["accuracy"] is not None
    whole = Experiment.create(cfg, tmp_path / "whole", FailAll(probe.fed, probe.model)).run(progress=False)
    assert _strip_seconds(summary) == _strip_seconds(whole)


def _strip_seconds(obj):
    if isinstance(obj, dict):
        return {k: _strip_seconds(v) for k, v in obj.items() if k not in ("seconds", "elapsed")}
    return obj


def test_clustering_scores_count_placed_participants_only():
    labels = np.array([0, 0, 1, -1, 1, 0])
    groups = np.array([0, 0, 1, 1, 1, 0])
    s = metrics.clustering_scores(labels, groups, participants=[0, 1, 2, 3, 4])
    assert s["placed"] == 4 and s["n_clusters"] == 2 and s["ari"] == 1.0
    s = metrics.clustering_scores(np.full(6, -1), groups, participants=[0, 1])
    assert s["placed"] == 0 and s["ari"] is None and s["n_clusters"] == 0


def _label_cosines_by_pairs(counts: np.ndarray, labels: np.ndarray) -> dict:
    """Every pair's cosine from the raw histograms, averaged (zero histogram: cosine 0)."""

    def cos(a, b):
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))

    pairs = [(i, j) for i in range(len(labels)) for j in range(len(labels)) if i != j]
    within = [cos(counts[i], counts[j]) for i, j in pairs if labels[i] == labels[j]]
    every = [cos(counts[i], counts[j]) for i, j in pairs]
    return {
        "label_cos_within": float(np.mean(within)) if within else None,
        "label_cos_all": float(np.mean(every)) if every else None,
    }


@settings(deadline=None, max_examples=150)
@given(st.integers(1, 12), st.integers(1, 6), st.data())
def test_label_cosines_equal_the_mean_over_pairs(n, classes, data):
    counts = np.array(
        data.draw(st.lists(st.lists(st.integers(0, 30), min_size=classes, max_size=classes), min_size=n, max_size=n)),
        dtype=float,
    )
    labels = np.array(data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    norms = np.linalg.norm(counts, axis=1, keepdims=True)
    unit = np.divide(counts, norms, out=np.zeros_like(counts), where=norms > 0)
    got, want = metrics.label_cosines(unit, labels), _label_cosines_by_pairs(counts, labels)
    for key in want:
        assert (got[key] is None) == (want[key] is None), (key, got, want)
        if want[key] is not None:
            assert got[key] == pytest.approx(want[key], abs=1e-12), (key, got, want)


def test_label_cosines_tell_a_label_partition_from_a_random_one():
    fed = build("dirichlet", "digits", 40, 30, seed=0, alpha=0.1)
    dists = fed.label_distributions()
    assert dists.shape == (40, 10) and np.allclose(np.linalg.norm(dists, axis=1), 1.0)
    by_label = dists.argmax(axis=1)  # clusters of clients sharing their most common label
    random = np.random.default_rng(0).permutation(by_label)
    follows = metrics.clustering_scores(by_label, None, list(range(40)), dists)
    ignores = metrics.clustering_scores(random, None, list(range(40)), dists)
    assert follows["label_cos_all"] == pytest.approx(ignores["label_cos_all"])
    assert follows["label_cos_within"] > 0.7 > follows["label_cos_all"] + 0.4  # 0.82 and 0.20
    assert abs(ignores["label_cos_within"] - ignores["label_cos_all"]) < 0.15
    held = metrics.clustering_scores(np.where(np.arange(40) < 20, by_label, -1), None, list(range(40)), dists)
    assert held["placed"] == 20  # unplaced clients count in neither mean
    assert held["label_cos_all"] == pytest.approx(metrics.label_cosines(dists[:20], by_label[:20])["label_cos_all"])


@pytest.mark.long  # two whole runs an algorithm: make test, not make test-fast
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_evaluating_changes_no_algorithms_training(name, tmp_path):
    # reproductions evaluate the costly runs every 5th or 10th round and compare them with runs
    # evaluated every round: evaluation must leave the state, RNG states included, as it was
    sets = [f"algorithm.{k}={v}" for k, v in PARAMS.get(name, {}).items()]
    states = []
    for every in (1, 4):
        cfg = configure.load(
            overrides=[
                "scenario.n_clients=16",
                "scenario.holdout=0.25",
                "run.rounds=4",
                "run.sample_rate=0.5",
                "run.engine=sequential",
                f"run.eval_every={every}",
                f"algorithm.name={name}",
                *sets,
            ]
        )
        out = tmp_path / str(every)
        summary = Experiment.create(cfg, out).run(progress=False)
        states.append((checkpoint.load(out / "checkpoint.safetensors")[0], summary))
    (a, sa), (b, sb) = states
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (sa["accuracy"], sa["n_clusters"], sa["heldout"]) == (sb["accuracy"], sb["n_clusters"], sb["heldout"])


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in ("ifca", "flhc", "ditto") else pytest.mark.long) for n in ALGORITHMS],
)
def test_evaluations_computed_once_give_the_numbers_of_computing_each(name, tmp_path, monkeypatch):
    """An evaluation answered from memory (the same client, split and weights evaluated before)
    gives every number of the run evaluated afresh each time, to the bit: every metrics row
    (times aside) and every state tensor; IFCA, FL+HC and Ditto reuse some."""
    from stocfl.executors.base import Executor

    runs = []
    for memo in (False, True):
        monkeypatch.setattr(Executor, "memo_evaluations", memo)
        cfg = configure.load(
            overrides=[
                "scenario.n_clients=16",
                "scenario.holdout=0.25",
                "run.rounds=6",
                "run.eval_every=2",
                "run.sample_rate=0.5",
                f"algorithm.name={name}",
                *(f"algorithm.{k}={json.dumps(v)}" for k, v in PARAMS.get(name, {}).items()),
            ]
        )
        out = tmp_path / str(memo)
        exp = Experiment.create(cfg, out)
        exp.run(progress=False)
        rows = [{k: v for k, v in json.loads(x).items() if k != "seconds"} for x in (out / "metrics.jsonl").open()]
        runs.append((rows, checkpoint.load(out / "checkpoint.safetensors")[0], exp))
    (rows, state, _), (rows_memo, state_memo, exp) = runs
    assert rows_memo == rows
    assert set(state) == set(state_memo) and all(torch.equal(state[k], state_memo[k]) for k in state)
    if name in ("ifca", "flhc", "ditto"):
        assert exp.executor.evaluations_reused > 0
