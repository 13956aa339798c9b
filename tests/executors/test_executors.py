import copy

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stocfl.algorithms.stocfl.representation import Represent
from stocfl.client.models import build_module, linear_anchor_weights, make_model
from stocfl.client.tasks import Evaluate, Train, task_seed
from stocfl.client.training import LocalTraining, batch_plan
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.errors import UserError
from stocfl.executors import BatchedExecutor, SequentialExecutor, choose_engine
from tests.reference import plain_training

FED = build("dirichlet", load_dataset("digits"), 16, 30, alpha=0.5, seed=0)  # unequal client sizes
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)


def _tasks(batch_size, prox=True):
    center = W0 + 0.05 * torch.randn(W0.shape, generator=torch.Generator().manual_seed(1))
    return [
        Train(
            i,
            W0 + 0.001 * i,
            local=LocalTraining.sgd(3, batch_size, 0.1),
            seed=task_seed(0, 1, i),
            prox_center=center if prox and i % 2 else None,
            prox_weight=0.5,
        )
        for i in range(FED.n_clients)
    ]


@pytest.mark.parametrize("batch_size", [0, 7, 10])
@pytest.mark.parametrize("chunk", [0, 5])
def test_batched_equals_sequential(batch_size, chunk):
    assert len(set(FED.train_sizes.tolist())) > 3
    tasks = _tasks(batch_size)
    a = SequentialExecutor(FED, MODEL).execute(tasks)
    b = BatchedExecutor(FED, MODEL, chunk_size=chunk).execute(tasks)
    for x, y, t in zip(a, b, tasks):
        assert x.n_samples == y.n_samples == FED.train_sizes[t.client]
        assert torch.allclose(x.weights, y.weights, atol=1e-5, rtol=0)
        assert not torch.equal(x.weights, t.weights)


def test_sequential_matches_a_plain_pytorch_loop():
    """Reference: nn.Module + torch.optim.SGD + the same batch order, prox term by autograd."""
    t = _tasks(7)[3]
    assert t.prox_center is not None
    ref = plain_training(build_module("auto", FED.input_shape, 10), t, *FED.train_data(t.client))
    got = SequentialExecutor(FED, MODEL).execute([t])[0].weights
    assert torch.allclose(ref, got, atol=1e-5)


def test_same_seed_same_weights_other_seed_other_weights():
    t = _tasks(7)[0]
    ex = SequentialExecutor(FED, MODEL)
    assert torch.equal(ex.execute([t])[0].weights, ex.execute([t])[0].weights)
    other = copy.copy(t)
    object.__setattr__(other, "seed", t.seed + 1)
    assert not torch.equal(ex.execute([t])[0].weights, ex.execute([other])[0].weights)


def test_evaluation_fast_path_is_exact():
    ex = SequentialExecutor(FED, MODEL)
    shared = [Evaluate(i, W0) for i in range(FED.n_clients)]
    alone = [Evaluate(i, W0.clone()) for i in range(FED.n_clients)]  # distinct tensors: no grouping
    for a, b in zip(ex.execute(shared), ex.execute(alone)):
        assert a.correct == b.correct and a.n_samples == b.n_samples and abs(a.loss - b.loss) < 1e-6
    x, y = FED.test_data(5)
    logits = MODEL.forward(W0, x)
    assert ex.execute(shared)[5].correct == int((logits.argmax(1) == y).sum())
    tr = ex.execute([Evaluate(5, W0, "train")])[0]
    assert tr.n_samples == FED.train_sizes[5]


def test_mixed_task_list_keeps_order():
    anchor = linear_anchor_weights(FED.input_shape, 10, 0)
    tasks = [Evaluate(0, W0), _tasks(0)[1], Represent(2, anchor, anchor_model="linear"), Evaluate(3, W0, "train")]
    out = BatchedExecutor(FED, MODEL).execute(tasks)
    assert [type(r).__name__ for r in out] == ["Evaluated", "Trained", "Represented", "Evaluated"]


def test_wrong_weight_shape_is_refused():
    with pytest.raises(UserError, match="parameters"):
        SequentialExecutor(FED, MODEL).execute([Train(0, torch.zeros(3), LocalTraining.sgd(1, 0, 0.1), 0)])


def test_auto_engine_rule():
    assert choose_engine("auto", 2410, 10, 30) == "batched"  # digits model: overhead-bound
    assert choose_engine("auto", 1_628_170, 0, 200) == "sequential"  # MLP-2048, full batch: compute-bound
    assert choose_engine("sequential", 10, 1, 1) == "sequential"
    assert choose_engine("auto", 2410, 10, 30, padding=3.0) == "sequential"  # a padded stack wastes 3x


def test_auto_counts_a_convolutions_weights_at_every_output_pixel():
    """The StoCFL authors' CIFAR-10 LeNet has 62,006 parameters, and a step of 50 images about
    160 MFLOP: counted as a dense model's (6 x 62,006 x 50 = 18.6 MFLOP) it looked overhead-bound
    and went batched, where it ran 1.9x slower than client by client. A dense model's count is
    its parameters, as before."""
    from stocfl.client.models import make_model

    lenet, _ = make_model("cifar_lenet", (3, 32, 32), 10, 200, 0)
    assert lenet.step_params((3, 32, 32)) == 658_238
    assert choose_engine("auto", lenet.n_params, 50, 8000) == "batched"  # the dense count
    assert choose_engine("auto", lenet.step_params((3, 32, 32)), 50, 8000) == "sequential"
    for name, shape in (("mlp", (1, 28, 28)), ("auto", (1, 8, 8))):
        dense, _ = make_model(name, shape, 10, 200, 0)
        assert dense.step_params(shape) == dense.n_params


def test_padding_factor_against_its_definition():
    """Equal sizes: no padding; otherwise the mean over draws of m x max / sum, as written."""
    import numpy as np

    from stocfl.executors.registry import padding_factor

    assert padding_factor([50] * 40, 4) == 1.0
    sizes = np.array([1, 1, 1, 97])
    assert padding_factor(sizes, 4) == 4 * 97 / 100  # every client each round
    rng = np.random.default_rng(0)
    want = np.mean([2 * sizes[p].max() / sizes[p].sum() for p in (rng.choice(4, 2, replace=False) for _ in range(32))])
    assert padding_factor(sizes, 2) == want


def test_batch_plan_covers_every_sample_once_per_epoch():
    plan = batch_plan(23, 2, 5, seed=9)
    for epoch in plan:
        assert sorted(torch.cat(epoch).tolist()) == list(range(23)) and [len(b) for b in epoch] == [5, 5, 5, 5, 3]
    assert not torch.equal(torch.cat(plan[0]), torch.cat(plan[1]))
    assert batch_plan(10, 3, 0, 1) == [None] * 3 and batch_plan(10, 1, 10, 1) == [None]
    assert np.array_equal(torch.cat(batch_plan(23, 1, 5, 9)[0]), torch.cat(batch_plan(23, 1, 5, 9)[0]))


def test_the_old_name_of_execute_still_works_or_is_refused_by_name():
    """``Executor.run(tasks)`` became ``execute(tasks)``: a call to the old name still answers
    (with a DeprecationWarning); a subclass or an engine's object with only ``run`` would never
    be called by the round loop, so it is refused in one line that names the new method."""
    import stocfl
    from stocfl.executors import Executor, make_executor
    from stocfl.executors.registry import ENGINES

    ex = SequentialExecutor(FED, MODEL)
    t = Train(1, W0, LocalTraining.sgd(1, 0, 0.1), 1)
    with pytest.warns(DeprecationWarning, match=r"now Executor\.execute"):
        old = ex.run([t])
    assert torch.equal(old[0].weights, ex.execute([t])[0].weights)
    with pytest.raises(UserError, match=r"Mine\.run\(tasks\).*now execute\(tasks\)"):

        class Mine(Executor):
            def run(self, tasks):
                return []

    class OnlyRun:  # an engine's object that is no Executor and has the old method only
        name = "only-run"

        def run(self, tasks):
            return []

    stocfl.register_engine(stocfl.Engine("only-run", "the old method only", executor=lambda f, m, c: OnlyRun()))
    try:
        with pytest.raises(UserError, match=r"OnlyRun, which has no execute\(tasks\).*run\(tasks\) is now execute"):
            make_executor("only-run", FED, MODEL, None)
    finally:
        del ENGINES["only-run"]


@settings(max_examples=30, deadline=None)
@given(
    batch_size=st.sampled_from([0, 7]),
    lowrank=st.booleans(),
    shared=st.sampled_from(["one center", "fedprox", "none"]),
    every=st.integers(1, 3),
    mu=st.sampled_from([0.0, 0.5]),
    chunk=st.sampled_from([0, 5]),
)
def test_a_shared_center_broadcast_trains_as_the_centers_stacked(batch_size, lowrank, shared, every, mu, chunk):
    """The batched and low-rank engines broadcast a proximal center shared by every row that has
    one (no copy a row) and are told FedProx's center is its start (no model-sized comparison);
    the replies are the same to the bit as with a copy of the center for every row, which they
    once stacked and compared; and each reply is its own row."""
    start = W0 + 0.01
    center = W0 + 0.05 * torch.randn(W0.shape, generator=torch.Generator().manual_seed(2))

    def tasks(copies: bool):
        out = []
        for i in range(FED.n_clients):
            w = start if shared == "fedprox" else W0 + 0.001 * i
            c = (w if shared == "fedprox" else center) if i % every == 0 else None
            if copies and c is not None:
                c = c.clone()  # the same numbers in a tensor of its own: stacked and compared as before
            out.append(Train(i, w, LocalTraining.sgd(2, batch_size, 0.1), task_seed(0, 1, i), c, mu))
        return out

    ex = BatchedExecutor(FED, MODEL, chunk_size=chunk, lowrank=lowrank)
    told, stacked = ex.execute(tasks(False)), ex.execute(tasks(True))
    for a, b in zip(told, stacked):
        assert torch.equal(a.weights, b.weights)
    told[0].weights.add_(1.0)  # a reply's row is its own
    assert torch.equal(told[1].weights, stacked[1].weights)


@settings(max_examples=30, deadline=None)
@given(
    batch_size=st.sampled_from([0, 7, 30]),
    prox=st.sampled_from(["none", "some rows", "every row"]),
    mu=st.sampled_from([0.0, 0.3]),
    chunk=st.sampled_from([0, 1, 5]),
    hidden=st.sampled_from([0, 16]),
    weighted=st.booleans(),
)
def test_gradients_taken_per_tensor_step_as_the_flat_vectors_gradient(batch_size, prox, mu, chunk, hidden, weighted):
    """Plain SGD on the batched engine takes each of the model's tensors' gradients apart (no
    model-sized concatenation a step); its replies are those of the flat vector's gradient and
    step to the bit, with and without proximal centers and per-sample weights (the mixture
    family's M-step)."""
    model, w0 = make_model("mlp" if hidden else "auto", FED.input_shape, 10, hidden, seed=0)
    center = w0 + 0.05 * torch.randn(w0.shape, generator=torch.Generator().manual_seed(3))
    tasks = [
        Train(
            i,
            w0 + 0.001 * i,
            LocalTraining.sgd(2, batch_size, 0.1),
            task_seed(0, 1, i),
            center if prox == "every row" or (prox == "some rows" and i % 2) else None,
            mu,
        )
        for i in range(FED.n_clients)
    ]
    q = None
    if weighted:
        gen = torch.Generator().manual_seed(4)
        q = [torch.rand(len(FED.train_data(i)[1]), generator=gen) for i in range(FED.n_clients)]
    apart, flat = BatchedExecutor(FED, model, chunk_size=chunk), BatchedExecutor(FED, model, chunk_size=chunk)
    flat.split_gradients = False
    for a, b in zip(apart.train(tasks, q), flat.train(tasks, q)):
        assert torch.equal(a.weights, b.weights)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 300),
    pull=st.sampled_from(["none", "shared", "own"]),
    block=st.integers(1, 4096),
    seed=st.integers(0, 2**16),
)
def test_the_sgd_step_in_cached_blocks_is_the_whole_chunks_to_the_bit(rows, cols, pull, block, seed):
    """The batched engine's plain SGD step runs a block of rows at a time (its passes made
    while the block stays in cache): every entry the same as the plain formula over the
    whole chunk, whatever the block (from one row to all), centers shared (broadcast) or own."""
    from stocfl.executors import batched

    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen)
    g = torch.randn(rows, cols, generator=gen)
    mu = torch.rand(rows, generator=gen) * (torch.rand(rows, generator=gen) > 0.3)
    step = (0.05 * (torch.rand(rows, generator=gen) > 0.2).float())[:, None]
    center = {
        "none": None,
        "shared": torch.randn(cols, generator=gen).expand(rows, -1),
        "own": torch.randn(rows, cols, generator=gen),
    }[pull]
    plain_w, plain_g = w.clone(), g.clone()
    if center is not None:  # the plain formula, over the whole chunk at once
        plain_g.add_((plain_w - center).mul_(mu[:, None]))
    plain_w.sub_(plain_g.mul_(step))
    batched.sgd_step(w, g, center, mu, step, block_bytes=block)
    assert torch.equal(w, plain_w)
