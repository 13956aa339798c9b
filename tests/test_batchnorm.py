"""Models with BatchNorm: running statistics travel and average with the weights; local
training equals a plain nn.Module + torch.optim loop in train mode; both executors; a small
ResNet-style model on real CIFAR-10; the README's second API example (own arrays, own
BatchNorm model, Adam, StoCFL, in memory)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stocfl
from stocfl.data import load_dataset
from stocfl.executors import BatchedExecutor, SequentialExecutor
from stocfl.models import FlatModel
from stocfl.scenarios import build
from stocfl.tasks import Evaluate, Train, task_seed
from stocfl.training import batch_plan
from test_api import rotated_clients


def bn_mlp(in_features=64, hidden=32, n_classes=10):
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.BatchNorm1d(hidden), nn.ReLU(),
                         nn.Linear(hidden, n_classes))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return torch.relu(x + self.body(x))


def small_resnet(n_classes=10, c=16):
    return nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(), Block(c),
                         nn.MaxPool2d(2), Block(c), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_classes))


FED = build("dirichlet", load_dataset("digits"), 8, 30, alpha=0.5, seed=0)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_local_training_equals_a_plain_loop_in_train_mode(optimizer):
    torch.manual_seed(0)
    module = bn_mlp()
    flat = FlatModel(module)
    w0 = FlatModel.flatten(module)
    assert flat.has_buffers and flat.n_params > flat.n_trainable
    t = Train(2, w0, 2, 7, 0.05, task_seed(0, 1, 2), optimizer=optimizer)
    ref = bn_mlp()
    ref.load_state_dict(flat.state_dict(w0))
    opt = (torch.optim.Adam(ref.parameters(), lr=0.05, foreach=False) if optimizer == "adam"
           else torch.optim.SGD(ref.parameters(), lr=0.05))
    ref.train()
    x, y = FED.train_data(2)
    for epoch in batch_plan(len(y), t.epochs, t.batch_size, t.seed):
        for idx in epoch:
            opt.zero_grad()
            nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
            opt.step()
    got = SequentialExecutor(FED, flat).run([t])[0].weights
    want = FlatModel.flatten(ref)
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert not torch.equal(got[flat.n_trainable:], w0[flat.n_trainable:]), "the running statistics moved"
    batched = BatchedExecutor(FED, flat).run([t])[0].weights
    assert torch.equal(batched, got)
    (ev,) = SequentialExecutor(FED, flat).run([Evaluate(2, got)])  # eval mode: the running statistics
    ref.eval()
    xt, yt = FED.test_data(2)
    assert ev.correct == int((ref(xt).argmax(1) == yt).sum())


def test_running_statistics_average_with_the_weights():
    result = stocfl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 3, "sample_rate": 0.5},
                         "scenario": {"name": "iid", "n_clients": 8}}, model=bn_mlp())
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
    result = stocfl.run({"algorithm": {"name": "stocfl"}, "run": {"rounds": 10, "sample_rate": 0.5},
                         "train": {"optimizer": "adam", "lr": 0.01, "epochs": 2}}, federation=fed, model=bn_mlp())
    assert list(tmp_path.iterdir()) == []
    assert result.summary["ari"] == 1.0 and result.summary["accuracy"] > 0.6, result.summary


def test_a_small_resnet_with_batchnorm_learns_cifar10(data_dir):
    torch.manual_seed(0)
    result = stocfl.run({"algorithm": {"name": "fedavg"}, "run": {"rounds": 4, "sample_rate": 1.0, "eval_every": 4},
                         "scenario": {"name": "iid", "dataset": "cifar10", "data_dir": str(data_dir),
                                      "n_clients": 4, "samples_per_client": 250, "test_per_client": 100},
                         "train": {"optimizer": "adam", "lr": 0.01, "epochs": 1, "batch_size": 25}},
                        model=small_resnet())
    assert result.summary["accuracy"] > 0.2, result.summary  # chance is 0.1; measured 0.275
    assert int(result.models["global"]["1.num_batches_tracked"]) > 0
