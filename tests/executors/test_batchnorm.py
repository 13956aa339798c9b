"""Models with BatchNorm: running statistics travel and average with the weights; local
training equals a plain nn.Module + torch.optim loop in train mode; both executors; a small
ResNet-style model on real CIFAR-10; the README's second API example (own arrays, own
BatchNorm model, Adam, StoCFL, in memory)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stocfl
from stocfl.client.models import FlatModel
from stocfl.client.optim import Optimizer
from stocfl.client.tasks import Evaluate, Train, task_seed
from stocfl.client.training import LocalTraining, batch_plan
from stocfl.data.datasets import load_dataset
from stocfl.data.scenarios import build
from stocfl.executors import BatchedExecutor, SequentialExecutor
from tests.experiment.test_api import rotated_clients

ONE_EPOCH = LocalTraining.sgd(1, 0, 0.1)  # one full-batch epoch of plain SGD


def bn_mlp(in_features=64, hidden=32, n_classes=10):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, n_classes)
    )


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.Conv2d(c, c, 3, padding=1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x):
        return torch.relu(x + self.body(x))


def small_resnet(n_classes=10, c=16):
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1, bias=False),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        Block(c),
        nn.MaxPool2d(2),
        Block(c),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(c, n_classes),
    )


FED = build("dirichlet", load_dataset("digits"), 8, 30, alpha=0.5, seed=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_local_training_equals_a_plain_loop_in_train_mode(optimizer):
    torch.manual_seed(0)
    module = bn_mlp()
    flat = FlatModel(module)
    w0 = FlatModel.flatten(module)
    assert flat.has_buffers and flat.n_params > flat.n_trainable
    t = Train(2, w0, LocalTraining(2, 7, Optimizer(optimizer, 0.05)), task_seed(0, 1, 2))
    ref = bn_mlp()
    ref.load_state_dict(flat.state_dict(w0))
    opt = (
        torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False)
        if optimizer == "adam"
        else torch.optim.SGD(ref.parameters(), lr=0.05)
    )
    ref.train()
    x, y = FED.train_data(2)
    for epoch in batch_plan(len(y), t.local.epochs, t.local.batch_size, t.seed):
        for idx in epoch:
            opt.zero_grad()
            nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    got = SequentialExecutor(FED, flat).execute([t])[0].weights
    want = FlatModel.flatten(ref)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert not torch.equal(got[flat.n_trainable :], w0[flat.n_trainable :]), "the running statistics moved"
    batched = BatchedExecutor(FED, flat).execute([t])[0].weights
    assert torch.equal(batched, got)
    (ev,) = SequentialExecutor(FED, flat).execute([Evaluate(2, got)])  # eval mode: the running statistics
    ref.eval()
    xt, yt = FED.test_data(2)
    assert ev.correct == int((ref(xt).argmax(1) == yt).sum())


def test_running_statistics_average_with_the_weights():
    result = stocfl.run(
        {
            "algorithm": {"name": "fedavg"},
            "run": {"rounds": 3, "sample_rate": 0.5},
            "scenario": {"name": "iid", "n_clients": 8},
        },
        model=bn_mlp(),
    )
    g = result.models["global"]
    assert g["2.num_batches_tracked"].dtype == torch.int64 and int(g["2.num_batches_tracked"]) > 0
    assert not torch.allclose(g["2.running_var"], torch.ones(32))
    fresh = bn_mlp()
    fresh.load_state_dict(g)  # every tensor of the state_dict, buffers included


def test_the_second_api_example_own_bn_model_adam_stocfl_in_memory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, test, groups = rotated_clients()
    fed = stocfl.Federation.from_arrays(train, test, groups)
    torch.manual_seed(0)
    result = stocfl.run(
        {
            "algorithm": {"name": "stocfl"},
            "run": {"rounds": 10, "sample_rate": 0.5},
            "train": {"optimizer": "adam", "lr": 0.01, "epochs": 2},
        },
        federation=fed,
        model=bn_mlp(),
    )
    assert list(tmp_path.iterdir()) == []
    assert result.summary["ari"] == 1.0 and result.summary["accuracy"] > 0.6, result.summary


@pytest.mark.long
def test_a_small_resnet_with_batchnorm_learns_cifar10(data_dir):
    torch.manual_seed(0)
    result = stocfl.run(
        {
            "algorithm": {"name": "fedavg"},
            "run": {"rounds": 4, "sample_rate": 1.0, "eval_every": 4},
            "scenario": {
                "name": "iid",
                "dataset": "cifar10",
                "data_dir": str(data_dir),
                "n_clients": 4,
                "samples_per_client": 250,
                "test_per_client": 100,
            },
            "train": {"optimizer": "adam", "lr": 0.01, "epochs": 1, "batch_size": 25},
        },
        model=small_resnet(),
    )
    assert result.summary["accuracy"] > 0.2, result.summary  # chance is 0.1; measured 0.275
    assert int(result.models["global"]["1.num_batches_tracked"]) > 0


# ---- FedBN: train.local_bn --------------------------------------------------------------------
def feature_shift_clients(per_group=2, per_client=30, test=20):
    """Digits whose second group has its pixel intensities inverted and scaled (FedBN's
    feature-shift setting: same labels, different input statistics)."""
    from stocfl.data.datasets import load_dataset as load

    d = load("digits")
    rng = np.random.default_rng(1)
    train, tests, groups = [], [], []
    for g in range(2):
        shift = (lambda x: 3.0 * (1.0 - x) + 0.5) if g else (lambda x: x)
        for _ in range(per_group):
            i = rng.choice(len(d.y_train), per_client, replace=False)
            j = rng.choice(len(d.y_test), test, replace=False)
            train.append((shift(d.x_train[i]).numpy(), d.y_train[i].numpy()))
            tests.append((shift(d.x_test[j]).numpy(), d.y_test[j].numpy()))
            groups.append(g)
    return train, tests, groups


def fedbn_reference(module, train, test, rounds, epochs, lr):
    """FedBN as a plain torch loop: every client trains a copy of the global module with its
    own BatchNorm entries (torch.optim.SGD, full batch, train mode) and keeps them; the server
    averages every entry weighted by |D_i|; each client is evaluated with the global model and
    its own BatchNorm."""
    g = copy.deepcopy(module)
    norms = {n for n, m in g.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    own: dict[int, dict[str, torch.Tensor]] = {}

    def with_own(i):
        m = copy.deepcopy(g)
        if i in own:
            m.load_state_dict({**m.state_dict(), **own[i]})
        return m

    for _ in range(rounds):
        states, sizes = [], []
        for i, (x, y) in enumerate(train):
            m = with_own(i)
            m.train()
            opt = torch.optim.SGD(m.parameters(), lr=lr)
            for _ in range(epochs):
                opt.zero_grad()
                F.cross_entropy(m(torch.as_tensor(x)), torch.as_tensor(y)).backward()
                opt.step()
            sd = m.state_dict()
            own[i] = {k: v.clone() for k, v in sd.items() if k.rpartition(".")[0] in norms}
            states.append(sd)
            sizes.append(len(y))
        g.load_state_dict(
            {
                k: (sum(n * s[k].double() for s, n in zip(states, sizes)) / sum(sizes)).to(v.dtype)
                for k, v in states[0].items()
            }
        )
    correct = []
    for i, (x, y) in enumerate(test):
        m = with_own(i).eval()
        with torch.no_grad():
            correct.append(int((m(torch.as_tensor(x)).argmax(1) == torch.as_tensor(y)).sum()))
    return g, own, correct


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_local_bn_is_fedbn_against_a_plain_torch_loop(engine):
    from stocfl.experiment.loop import Experiment

    train, test, groups = feature_shift_clients()
    fed = stocfl.Federation.from_arrays(train, test, groups)
    torch.manual_seed(0)
    module = bn_mlp()
    cfg = stocfl.as_config(
        {
            "algorithm": {"name": "fedavg"},
            "run": {"rounds": 3, "sample_rate": 1.0, "engine": engine},
            "train": {"epochs": 2, "batch_size": 0, "lr": 0.1, "local_bn": True},
        }
    )
    exp = Experiment.create(cfg, None, federation=fed, module=module)
    exp.run(progress=False)
    g, own, correct = fedbn_reference(module, train, test, 3, 2, 0.1)
    flat = exp.model
    assert torch.allclose(exp.algorithm.global_model(), FlatModel.flatten(g), atol=1e-5)
    idx = flat.batchnorm_entries()
    for i in range(fed.n_clients):
        mine = torch.cat([own[i][n].reshape(-1).float() for n in flat.names if n in own[i]])
        assert torch.allclose(exp.local.store.get(i), mine, atol=1e-5), i
    assert [exp.last_eval[i].correct for i in range(fed.n_clients)] == correct
    assert len(idx) == 32 * 2 + 32 * 2 + 1  # weight, bias, running mean, running var, batch count


def test_local_bn_changes_the_run_checkpoints_and_needs_batchnorm(tmp_path):
    train, test, groups = feature_shift_clients()
    fed = stocfl.Federation.from_arrays(train, test, groups)
    base = {
        "algorithm": {"name": "stocfl"},
        "run": {"rounds": 4, "sample_rate": 0.5},
        "train": {"epochs": 2, "lr": 0.1, "local_bn": True},
    }
    torch.manual_seed(0)
    module = bn_mlp()
    whole = stocfl.run(base, federation=fed, model=copy.deepcopy(module), out=tmp_path / "a")
    off = stocfl.run({**base, "train": {"epochs": 2, "lr": 0.1}}, federation=fed, model=copy.deepcopy(module))
    assert whole.metrics[-1]["accuracy"] != off.metrics[-1]["accuracy"] or not torch.equal(
        whole.models["global"]["2.running_mean"], off.models["global"]["2.running_mean"]
    )
    # stopped after 2 rounds and resumed: the same numbers as the run in one go
    from stocfl.experiment.loop import Experiment

    cfg = stocfl.as_config(base)
    Experiment.create(cfg, tmp_path / "b", federation=fed, module=copy.deepcopy(module)).run(
        progress=False, stop_after=2
    )
    again = stocfl.resume(tmp_path / "b", federation=fed, model=copy.deepcopy(module))
    assert [r["accuracy"] for r in again.metrics] == [r["accuracy"] for r in whole.metrics]
    assert (tmp_path / "b" / "local_bn.journal").exists()
    with pytest.raises(stocfl.UserError, match="local_bn = true keeps BatchNorm layers per client, but the model"):
        stocfl.run(base, federation=fed, model=nn.Sequential(nn.Flatten(), nn.Linear(64, 10)))


def test_local_bn_keeps_the_entries_of_the_clients_own_model():
    """Two Train tasks of one client in a list (Ditto's and StoCFL's global and own model): both
    start from the client's entries, and it keeps those of the task with a proximal center."""
    from stocfl.client.tasks import Trained
    from stocfl.executors.localbn import LocalBatchNorm

    local = LocalBatchNorm(torch.tensor([1, 3]), n_clients=2)
    seen = []

    def run(tasks):  # a client that adds 10 * (task number + 1) to whatever it is sent
        seen.extend(tasks)
        return [Trained(t.weights + 10 * (k + 1), 5) if isinstance(t, Train) else None for k, t in enumerate(tasks)]

    w, c = torch.zeros(4), torch.full((4,), 2.0)
    wrapped = local.wrap(run)
    wrapped(
        [
            Train(0, w, ONE_EPOCH, 0),
            Train(0, w, ONE_EPOCH, 0, prox_center=c, prox_weight=1.0),
        ]
    )
    assert torch.equal(local.store.get(0), torch.tensor([20.0, 20.0])) and 1 not in local.store
    seen.clear()
    wrapped([Train(0, w, ONE_EPOCH, 0, prox_center=c, prox_weight=1.0), Evaluate(0, w), Evaluate(1, w)])
    assert torch.equal(seen[0].weights, torch.tensor([0.0, 20.0, 0.0, 20.0]))
    assert torch.equal(seen[0].prox_center, torch.tensor([2.0, 20.0, 2.0, 20.0]))  # no pull on its own entries
    assert torch.equal(seen[1].weights, seen[0].weights) and seen[2].weights is w  # never trained: as sent
