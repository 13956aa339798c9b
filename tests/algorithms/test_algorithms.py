import dataclasses

import pytest
import torch

from stocfl.algorithms import ALGORITHMS, Context
from stocfl.algorithms.fedavg import FedAvg
from stocfl.algorithms.fedprox import FedProx
from stocfl.client.mixture import Mixture
from stocfl.client.models import make_model
from stocfl.client.training import LocalTraining
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor, SequentialExecutor

FED = build("dirichlet", load_dataset("digits"), 12, 30, alpha=1.0, seed=0)
MODEL, W0 = make_model("auto", FED.input_shape, 10, 0, seed=0)
CTX = Context(
    FED.n_clients,
    W0,
    local=LocalTraining.sgd(2, 10, 0.1),
    seed=0,
    input_shape=FED.input_shape,
    n_classes=10,
    init_model=lambda seed: make_model("auto", FED.input_shape, 10, 0, seed)[1],
    last_layer=MODEL.numels[-1] + MODEL.numels[-2],
)
FAST = {"flhc": {"warmup_rounds": 1}}


def test_fedavg_round_is_the_weighted_mean_of_local_models():
    ex = SequentialExecutor(FED, MODEL)
    alg = FedAvg(FedAvg.Params(), CTX)
    sampled = [1, 4, 7]
    local = ex.execute([alg.local_task(1, i, alg.w) for i in sampled])
    n = torch.tensor([float(FED.train_sizes[i]) for i in sampled])
    expected = sum(r.weights * k for r, k in zip(local, n)) / n.sum()
    alg.round(1, sampled, ex.execute)
    assert torch.allclose(alg.global_model(), expected, atol=1e-6)


def test_fedprox_mu_zero_is_fedavg_and_mu_pulls_toward_w():
    ex = SequentialExecutor(FED, MODEL)
    a, b = FedAvg(FedAvg.Params(), CTX), FedProx(FedProx.Params(mu=0.0), CTX)
    c = FedProx(FedProx.Params(mu=5.0), CTX)
    for t in (1, 2):
        for alg in (a, b, c):
            alg.round(t, [0, 3, 5, 8], ex.execute)
    assert torch.equal(a.global_model(), b.global_model())
    assert (c.global_model() - W0).norm() < (a.global_model() - W0).norm()


def test_chain_is_one_sequential_pass_as_the_stocfl_authors_code_trains_w():
    """chain = true: client j starts from client j-1's model (clients in sampled order), and w is
    the weighted mean of the chain; FedProx's chain keeps its pull toward the round's w; a
    chain of one client is FedAvg; StoCFL's w in a chain is FedAvg's in a chain, number for number."""
    from stocfl.algorithms.stocfl.algorithm import StoCFL

    ex = SequentialExecutor(FED, MODEL)
    sampled = [1, 4, 7]
    for alg in (FedAvg(FedAvg.Params(chain=True), CTX), FedProx(FedProx.Params(mu=2.0, chain=True), CTX)):
        start, models = W0, []
        for i in sampled:
            (r,) = ex.execute([alg.local_task(1, i, start)])
            models.append(r.weights)
            start = r.weights
        n = [float(FED.train_sizes[i]) for i in sampled]
        expected = sum(m * k for m, k in zip(models, n)) / sum(n)
        alg.round(1, sampled, ex.execute)
        assert torch.allclose(alg.global_model(), expected, atol=1e-6)
        plain = FedAvg(FedAvg.Params(), CTX).local_task(1, 4, models[0])
        same = torch.equal(ex.execute([plain])[0].weights, models[1])  # FedProx's pull is toward W0, not models[0]
        assert same if alg.name == "fedavg" else not same
    one, chain = FedAvg(FedAvg.Params(), CTX), FedAvg(FedAvg.Params(chain=True), CTX)
    for t, i in enumerate([3, 8, 3], 1):
        one.round(t, [i], ex.execute)
        chain.round(t, [i], ex.execute)
    assert torch.equal(one.global_model(), chain.global_model())
    sto, avg = StoCFL(StoCFL.Params(chain=True), CTX), FedAvg(FedAvg.Params(chain=True), CTX)
    plain_sto = StoCFL(StoCFL.Params(), CTX)
    for alg in (sto, avg, plain_sto):
        alg.round(1, [0, 2, 9, 4, 6], ex.execute)
    assert torch.equal(sto.global_model(), avg.global_model())
    assert not torch.allclose(sto.global_model(), plain_sto.global_model(), atol=1e-4)
    assert all(torch.equal(sto.theta[k], plain_sto.theta[k]) for k in plain_sto.theta)  # same w to pull toward
    sto.round(2, [1, 2, 9, 5, 11], ex.execute)
    avg.round(2, [1, 2, 9, 5, 11], ex.execute)
    assert torch.equal(sto.global_model(), avg.global_model())


# Where a method has not yet left FedAvg, it must be FedAvg: same tasks, same seeds, same mean.
# CFL adds the mean update to w (w + mean(w_i - w)) where FedAvg takes mean(w_i): equal up to
# float rounding. IFCA's M = 1 model starts from w_0 here (its models are seeded apart).
REDUCES_TO_FEDAVG = {
    "cfl": ({"warmup": 100}, 1e-6),
    "ifca": ({"n_models": 1}, 0.0),
    "flhc": ({"warmup_rounds": 100}, 0.0),
    "ditto": ({}, 0.0),
    "stocfl": ({}, 0.0),
}


@pytest.mark.parametrize("name", list(REDUCES_TO_FEDAVG))
def test_a_method_that_has_not_left_fedavg_is_fedavg(name):
    params, tol = REDUCES_TO_FEDAVG[name]
    ctx = dataclasses.replace(CTX, init_model=lambda seed: W0.clone())
    ex = SequentialExecutor(FED, MODEL)
    ref, alg = FedAvg(FedAvg.Params(), ctx), ALGORITHMS[name](ALGORITHMS[name].Params(**params), ctx)
    for t, sampled in enumerate([[0, 2, 9, 4, 6], [1, 2, 9, 5, 11], list(range(12))], 1):
        ref.round(t, sampled, ex.execute)
        alg.round(t, sampled, ex.execute)
    assert not torch.equal(ref.global_model(), W0)
    gap = float((alg.global_model() - ref.global_model()).abs().max())
    assert gap <= tol, f"{name}: its global model is {gap:.2e} from FedAvg's"


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_same_on_both_executors_and_round_trips_state(name):
    cls = ALGORITHMS[name]
    runs = []
    params = cls.Params(**FAST.get(name, {}))
    execs = (SequentialExecutor(FED, MODEL), BatchedExecutor(FED, MODEL))
    for ex in execs:
        alg = cls(params, CTX)
        alg.round(1, [0, 2, 9, 4, 6], ex.execute)
        alg.round(2, [1, 2, 9, 5, 11], ex.execute)
        runs.append(alg)
    assert torch.allclose(runs[0].global_model(), runs[1].global_model(), atol=1e-5)
    assert (runs[0].cluster_labels() == runs[1].cluster_labels()).all()
    tensors, meta = runs[0].encode_state()
    fresh = cls(params, CTX)
    fresh.decode_state(tensors, meta)
    assert torch.equal(fresh.global_model(), runs[0].global_model())
    assert fresh.cluster_labels().shape == (FED.n_clients,)
    clients = list(range(FED.n_clients))
    for a, b in zip(fresh.client_models(clients, execs[0].execute), runs[0].client_models(clients, execs[0].execute)):
        if isinstance(a, Mixture):  # FedEM's: the components and the client's weights
            assert torch.equal(a.models, b.models) and torch.equal(a.weights, b.weights)
        else:
            assert torch.equal(a, b)
    # same seed, same numbers
    again = cls(params, CTX)
    again.round(1, [0, 2, 9, 4, 6], execs[0].execute)
    again.round(2, [1, 2, 9, 5, 11], execs[0].execute)
    assert torch.equal(again.global_model(), runs[0].global_model())
