"""The mixture family's client computations against plain references: the E-step against a
loop over samples and models, the weighted M-step against an nn.Module + torch.optim loop, the
batched executor's vectorised path against the reference on generated tasks, the mixture's
prediction against its definition, and the reply check against crafted replies."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from stocfl.client.mixture import (
    EvaluateMixture,
    Mixture,
    MixtureTrain,
    MixtureTrained,
    check_mixture_trained,
    evaluation_task,
    responsibilities,
)
from stocfl.client.models import FlatModel, build_module, make_model
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import BadResult, Evaluate, Train, out_of_bound
from stocfl.client.training import LocalTraining, batch_plan
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.errors import UserError
from stocfl.executors import BatchedExecutor, SequentialExecutor
from tests.reference import torch_optimizer

FED = build("dirichlet", load_dataset("digits"), 12, 25, alpha=0.5, seed=1)  # unequal client sizes
MODULE = build_module("auto", FED.input_shape, 10, 0)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
COMPONENTS = torch.stack([FlatModel.init_weights(MODULE, s) for s in (1, 2, 3)])
SEQ, BAT = SequentialExecutor(FED, MODEL), BatchedExecutor(FED, MODEL)
LOW = BatchedExecutor(FED, MODEL, lowrank=True)


def plain_e_step(losses, y, prior, bias, steps):
    """q_s(m) = pi_m exp(-l_ms + b_m[y_s]) / sum_k (...), sample by sample; pi <- mean_s q_s."""
    k, n = losses.shape
    pi = [1.0 / k] * k if prior is None else [float(p) for p in prior]
    q = [[0.0] * n for _ in range(k)]
    for _ in range(steps):
        for s in range(n):
            score = [
                math.log(max(pi[m], 1e-10)) - float(losses[m, s]) + (0.0 if bias is None else float(bias[m, y[s]]))
                for m in range(k)
            ]
            top = max(score)
            z = sum(math.exp(v - top) for v in score)
            for m in range(k):
                q[m][s] = math.exp(score[m] - top) / z
        pi = [sum(q[m]) / n for m in range(k)]
    return torch.tensor(q, dtype=torch.float64), torch.tensor(pi, dtype=torch.float64)


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(1, 4),
    n=st.integers(1, 12),
    steps=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    with_prior=st.booleans(),
    with_bias=st.booleans(),
)
def test_the_e_step_equals_its_definition_sample_by_sample(k, n, steps, seed, with_prior, with_bias):
    g = torch.Generator().manual_seed(seed)
    losses = torch.rand((k, n), generator=g) * 30
    y = torch.randint(0, 5, (n,), generator=g)
    prior = torch.softmax(torch.randn(k, generator=g), 0) if with_prior else None
    bias = -torch.log(torch.rand((k, 5), generator=g) + 1e-3) if with_bias else None
    q, pi = responsibilities(losses, y, prior, bias, steps)
    q_ref, pi_ref = plain_e_step(losses, y, prior, bias, steps)
    assert torch.allclose(q, q_ref, atol=1e-12) and torch.allclose(pi, pi_ref, atol=1e-12)


def plain_weighted_training(module: nn.Module, w, local, seed, x, y, q) -> torch.Tensor:
    """Local training on sum_b q_b l_b / |B| as a tutorial writes it (the FedEM authors' weighting)."""
    torch.nn.utils.vector_to_parameters(w.clone(), module.parameters())
    opt = torch_optimizer(local.optimizer, module.parameters())
    for epoch in batch_plan(len(y), local.epochs, local.batch_size, seed):
        for idx in epoch or [torch.arange(len(y))]:
            opt.zero_grad()
            per_sample = nn.functional.cross_entropy(module(x[idx]), y[idx], reduction="none")
            ((per_sample * q[idx]).sum() / len(idx)).backward()
            opt.step()
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach()


@pytest.mark.parametrize("local", [LocalTraining.sgd(2, 7, 0.1), LocalTraining(1, 0, Optimizer("adam", 0.01))])
def test_the_reference_is_the_e_step_then_each_model_trained_on_its_weights(local):
    x, y = FED.train_data(3)
    (r,) = SEQ.execute([MixtureTrain(3, COMPONENTS, local, 5)])
    losses = torch.stack(
        [nn.functional.cross_entropy(MODEL.forward(w, x), y, reduction="none") for w in COMPONENTS]
    ).detach()
    q, pi = plain_e_step(losses, y.tolist(), None, None, 1)
    assert torch.allclose(r.mixture.double(), pi, atol=1e-6)
    for m, w in enumerate(COMPONENTS):
        want = plain_weighted_training(build_module("auto", FED.input_shape, 10, 0), w, local, 5, x, y, q[m].float())
        assert torch.allclose(r.models[m], want, atol=1e-5), m
    mass = torch.zeros((3, 10), dtype=torch.float64).index_add_(1, y, q)
    assert torch.allclose(r.label_mass.double(), mass, atol=1e-4)


def test_no_epochs_is_the_e_step_alone_and_one_weight_everywhere_is_plain_training():
    (r,) = SEQ.execute([MixtureTrain(2, COMPONENTS, LocalTraining.sgd(0, 0, 0.1), 0, em_steps=30)])
    assert torch.equal(r.models, COMPONENTS) and abs(float(r.mixture.sum()) - 1) < 1e-6
    one = COMPONENTS[:1]  # K = 1: every weight is 1, the loss is the mean
    (a,) = SEQ.execute([MixtureTrain(2, one, LocalTraining.sgd(2, 5, 0.1), 9)])
    (b,) = SEQ.execute([Train(2, one[0], LocalTraining.sgd(2, 5, 0.1), 9)])
    assert torch.allclose(a.models[0], b.weights, atol=1e-6) and torch.equal(a.mixture, torch.ones(1))


@settings(max_examples=25, deadline=None)
@given(
    clients=st.lists(st.integers(0, FED.n_clients - 1), min_size=1, max_size=6),
    k=st.integers(1, 3),
    epochs=st.integers(0, 2),
    batch=st.sampled_from([0, 3, 8]),
    opt=st.sampled_from([Optimizer("sgd", 0.1), Optimizer("sgd", 0.05, momentum=0.9), Optimizer("adam", 0.01)]),
    with_prior=st.booleans(),
    with_bias=st.booleans(),
    steps=st.integers(1, 3),
    seed=st.integers(0, 1000),
    hard=st.booleans(),
    personal=st.lists(st.booleans(), min_size=6, max_size=6),
    lowrank=st.booleans(),
)
def test_the_batched_path_equals_the_reference(
    clients, k, epochs, batch, opt, with_prior, with_bias, steps, seed, hard, personal, lowrank
):
    """Soft and hard shares, the K weighted trainings and the personal proximal ones (FedSoft),
    mixed in one call, on the batched executor and its low-rank path."""
    g = torch.Generator().manual_seed(seed)
    local = LocalTraining(epochs, batch, opt)
    tasks = [
        MixtureTrain(
            i,
            COMPONENTS[:k] + 0.01 * torch.randn((k, len(W0)), generator=g),
            local,
            seed + i,
            prior=torch.softmax(torch.randn(k, generator=g), 0) if with_prior else None,
            label_bias=torch.randn((k, 10), generator=g) if with_bias else None,
            em_steps=steps,
            assign="hard" if hard else "soft",
            smoother=1e-4 if hard else 0.0,
            personal=W0 + 0.01 * torch.randn(len(W0), generator=g) if own else None,
            mu=0.5 if own else 0.0,
        )
        for i, own in zip(clients, personal)
    ]
    fast = LOW if lowrank else BAT
    for a, b in zip(SEQ.execute(tasks), fast.execute(tasks)):
        assert a.models.shape == b.models.shape and torch.allclose(a.models, b.models, atol=1e-5)
        assert torch.allclose(a.mixture, b.mixture, atol=1e-6) and torch.allclose(a.label_mass, b.label_mass, atol=1e-4)
        assert a.n_samples == b.n_samples


def test_a_mixture_predicts_with_its_weighted_probabilities():
    pi = torch.tensor([0.2, 0.5, 0.3])
    (r,) = SEQ.execute([evaluation_task(4, Mixture(COMPONENTS, pi))])
    x, y = FED.test_data(4)
    p = sum(pi[m] * torch.softmax(MODEL.forward(w, x), 1) for m, w in enumerate(COMPONENTS)).detach()
    assert r.correct == int((p.argmax(1) == y).sum()) and r.n_samples == len(y)
    assert abs(r.loss - float(-torch.log(p[torch.arange(len(y)), y]).mean())) < 1e-5
    one_hot = Mixture(COMPONENTS, torch.tensor([0.0, 1.0, 0.0]))  # all weight on one model: that model
    (a,) = SEQ.execute([evaluation_task(4, one_hot)])
    (b,) = SEQ.execute([Evaluate(4, COMPONENTS[1])])
    assert a.correct == b.correct and abs(a.loss - b.loss) < 1e-5
    assert isinstance(evaluation_task(4, COMPONENTS[0]), Evaluate)
    assert isinstance(evaluation_task(4, one_hot, "train"), EvaluateMixture)


GOOD = SEQ.execute([MixtureTrain(0, COMPONENTS, LocalTraining.sgd(1, 0, 0.1), 0)])[0]
TASK = MixtureTrain(0, COMPONENTS, LocalTraining.sgd(1, 0, 0.1), 0)
N0 = int(FED.train_sizes[0])


@pytest.mark.parametrize(
    "change, says",
    [
        ({"models": GOOD.models[:2]}, "models has shape"),
        ({"models": GOOD.models.clone().fill_(float("nan"))}, "NaN"),
        ({"mixture": torch.tensor([0.5, 0.5, 0.5])}, "not a distribution"),
        ({"mixture": torch.tensor([1.5, -0.5, 0.0])}, "not a distribution"),
        ({"mixture": torch.tensor([1.0, 0.0])}, "mixture has shape"),
        ({"label_mass": GOOD.label_mass * 2}, "label_mass sums to"),
        ({"label_mass": -GOOD.label_mass}, "label_mass sums to"),
        ({"label_mass": GOOD.label_mass[0]}, "label_mass has shape"),
        ({"n_samples": N0 + 1}, "n_samples"),
    ],
)
def test_a_crafted_reply_is_refused_by_name(change, says):
    with pytest.raises(BadResult, match=says):
        check_mixture_trained(TASK, dataclasses.replace(GOOD, **change), N0, 0)


def test_mixture_models_that_moved_far_beyond_the_model_and_the_others_are_out_of_bound():
    far = dataclasses.replace(GOOD, models=GOOD.models * 1e9)
    assert out_of_bound([TASK] * 3, [GOOD, far, GOOD]).keys() == {1}
    assert "moved" in out_of_bound([TASK], [far])[0] and not out_of_bound([TASK], [GOOD])


def test_a_reply_within_rounding_is_normalised_and_a_bad_task_is_one_line():
    off = dataclasses.replace(GOOD, mixture=GOOD.mixture * (1 + 5e-4))
    ok = check_mixture_trained(TASK, off, N0, 0)
    assert abs(float(ok.mixture.sum()) - 1) < 1e-6 and isinstance(ok, MixtureTrained)
    with pytest.raises(UserError, match=r"models have shape \(3,\)"):
        SEQ.execute([MixtureTrain(0, COMPONENTS[0, :3], LocalTraining.sgd(1, 0, 0.1), 0)])
    with pytest.raises(UserError, match="prior has shape"):
        SEQ.execute([MixtureTrain(0, COMPONENTS, LocalTraining.sgd(1, 0, 0.1), 0, prior=torch.ones(2) / 2)])


def test_fedrc_sends_minus_the_log_of_each_clusters_label_distribution():
    """FedRC's rule is FedEM's E-step with -log P(y; k): round 1 has no label masses yet (the
    plain E-step); from round 2 P(y; k) is the clients' reported masses summed, floored, and
    normalised per cluster, and the clusters' weights then differ from FedEM's."""
    from stocfl.algorithms import FedEM, FedRC
    from tests.test_common import Asked, context

    ctx = context(fed=FED, w0=W0)
    rc, em = FedRC(FedRC.Params(n_clusters=3), ctx), FedEM(FedEM.Params(n_components=3), ctx)
    asked = Asked(SEQ)
    first = [0, 1, 2, 3]
    rc.round(1, first, asked.execute)
    assert all(t.label_bias is None for t in asked.tasks)
    replies = SEQ.execute(asked.tasks)
    mass = sum(r.label_mass.double() for r in replies).clamp(min=1e-8)
    want = -torch.log(mass / mass.sum(1, keepdim=True))
    asked.tasks.clear()
    rc.round(2, [4, 5], asked.execute)
    assert all(torch.allclose(t.label_bias.double(), want, atol=1e-5) for t in asked.tasks)
    em.round(1, first, SEQ.execute)
    em.round(2, [4, 5], SEQ.execute)
    assert not torch.equal(rc.weights_of(4), em.weights_of(4))
    assert (tmp := rc.cluster_labels())[first + [4, 5]].min() >= 0 and (tmp[6:] == -1).all()


def test_hard_shares_count_each_sample_at_its_least_loss_and_smooth_the_empty_ones():
    """FedSoft's u_is: the share of samples whose loss is least under centre s (the first of
    equal losses), a centre with none gets sigma, and the weights are normalised again."""
    losses = torch.tensor([[1.0, 5.0, 2.0, 2.0], [3.0, 1.0, 2.0, 9.0], [4.0, 6.0, 7.0, 8.0]])
    y = torch.zeros(4, dtype=torch.long)
    q, pi = responsibilities(losses, y, None, None, 1, "hard", 1e-4)
    assert q.tolist() == [[1, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]
    want = torch.tensor([0.75, 0.25, 1e-4], dtype=torch.float64)
    assert torch.allclose(pi, want / want.sum(), atol=1e-15)
    _, unsmoothed = responsibilities(losses, y, None, None, 1, "hard", 0.0)
    assert unsmoothed.tolist() == [0.75, 0.25, 0.0]


def plain_proximal_training(w, centres, u, lam, local, seed, x, y) -> torch.Tensor:
    """f_i(w) + (lambda/2) sum_s u_s ||w - c_s||^2 by autograd over the sum as the paper writes
    it, with torch.optim, in the run's mini-batch order."""
    module = build_module("auto", FED.input_shape, 10, 0)
    torch.nn.utils.vector_to_parameters(w.clone(), module.parameters())
    opt = torch_optimizer(local.optimizer, module.parameters())
    for epoch in batch_plan(len(y), local.epochs, local.batch_size, seed):
        for idx in epoch or [torch.arange(len(y))]:
            opt.zero_grad()
            flat = torch.nn.utils.parameters_to_vector(module.parameters())
            prox = sum(float(u[s]) * ((flat - c) ** 2).sum() for s, c in enumerate(centres))
            (nn.functional.cross_entropy(module(x[idx]), y[idx]) + lam / 2 * prox).backward()
            opt.step()
    return torch.nn.utils.parameters_to_vector(module.parameters()).detach()


@pytest.mark.parametrize("local", [LocalTraining.sgd(2, 7, 0.1), LocalTraining(1, 5, Optimizer("adam", 0.01))])
def test_the_personal_model_trains_on_the_papers_proximal_sum(local):
    x, y = FED.train_data(5)
    own = W0 + 0.05
    (r,) = SEQ.execute([MixtureTrain(5, COMPONENTS, local, 3, assign="hard", smoother=1e-4, personal=own, mu=0.7)])
    assert r.models.shape == (1, len(W0))
    want = plain_proximal_training(own, COMPONENTS, r.mixture.double(), 0.7, local, 3, x, y)
    assert torch.allclose(r.models[0], want, atol=1e-5)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"assign": "hardest"}, "assign"),
        ({"smoother": 1.0}, "smoother"),
        ({"smoother": -1e-3}, "smoother"),
        ({"mu": 0.5}, "needs a personal model"),
        ({"personal": W0[:5], "mu": 0.5}, "personal has shape"),
        ({"personal": W0, "mu": -1.0}, "mu = -1.0"),
    ],
)
def test_a_bad_proximal_task_is_one_line(change, says):
    with pytest.raises(UserError, match=says):
        SEQ.execute([dataclasses.replace(TASK, **change)])


def test_a_personal_reply_must_be_one_model():
    task = dataclasses.replace(TASK, assign="hard", personal=W0, mu=0.1)
    (good,) = SEQ.execute([task])
    assert check_mixture_trained(task, good, N0, 0).models.shape == (1, len(W0))
    with pytest.raises(BadResult, match=r"expected \(1, "):
        check_mixture_trained(task, dataclasses.replace(good, models=GOOD.models), N0, 0)


def test_fedsoft_centres_are_the_importance_weighted_means_of_the_local_models():
    """Round 1: every client starts from w_0 and reports u_i; centre s becomes
    sum_i u_is n_i w_i / sum_i u_is n_i. Round 2 starts each sampled client from its own w_i;
    with sigma = 0 a centre that no sample fits keeps its value."""
    from stocfl.algorithms import FedSoft
    from tests.test_common import Asked, context

    ctx = context(fed=FED, w0=W0)
    soft = FedSoft(FedSoft.Params(n_clusters=3, smoother=0.0, lam=0.3), ctx)
    before = [c.clone() for c in soft.centres]
    asked = Asked(SEQ)
    soft.round(1, [0, 1, 2, 3], asked.execute)
    assert all(torch.equal(t.personal, W0) and t.mu == 0.3 and t.assign == "hard" for t in asked.tasks)
    replies = SEQ.execute(asked.tasks)
    for s in range(3):
        v = torch.tensor([float(r.mixture[s]) * r.n_samples for r in replies], dtype=torch.float64)
        if float(v.sum()) == 0:
            assert torch.equal(soft.centres[s], before[s])
        else:
            want = sum(v[j] / v.sum() * replies[j].models[0].double() for j in range(4)).float()
            assert torch.allclose(soft.centres[s], want, atol=1e-6), s
    asked.tasks.clear()
    soft.round(2, [2, 4], asked.execute)
    assert torch.equal(asked.tasks[0].personal, replies[2].models[0]) and torch.equal(asked.tasks[1].personal, W0)
    labels = soft.cluster_labels()
    assert (labels[[0, 1, 2, 3, 4]] >= 0).all() and (labels[5:] == -1).all()
    models = soft.client_models([2, 7], SEQ.execute)  # 7 never trained: the centre it fits best
    assert any(models[1] is c for c in soft.centres)
