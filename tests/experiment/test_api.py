"""The Python API: the README's example, own data and models, names registered from user code
used from a TOML config, in-memory runs equal to runs on disk, one error form."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

import stocfl
from stocfl.algorithms.fedavg import FedAvg
from stocfl.cli import main
from stocfl.client.tasks import Train, Trained
from stocfl.data.datasets import load_dataset


def rotated_clients(n_per_group=4, per_client=30, test=20):
    """Digits split into clients, each group a rotation: plain arrays, as a user would have."""
    d = load_dataset("digits")
    rng = np.random.default_rng(0)
    train, tests, groups = [], [], []
    for g in range(2):
        for _ in range(n_per_group):
            i = rng.choice(len(d.y_train), per_client, replace=False)
            j = rng.choice(len(d.y_test), test, replace=False)
            rot = (lambda x: torch.rot90(x, 2, dims=(2, 3))) if g else (lambda x: x)
            train.append((rot(d.x_train[i]).numpy(), d.y_train[i].numpy()))
            tests.append((rot(d.x_test[j]).numpy(), d.y_test[j].numpy()))
            groups.append(g)
    return train, tests, groups


def test_the_readme_example_runs_in_memory_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    train, test, groups = rotated_clients()
    fed = stocfl.Federation.from_arrays(train=train, test=test, groups=groups)
    my_module = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    result = stocfl.run(
        {
            "algorithm": {"name": "stocfl", "tau": 0.5},
            "run": {"rounds": 20, "sample_rate": 0.5},
            "train": {"epochs": 2, "lr": 0.1},
        },
        federation=fed,
        model=my_module,
        out=None,
    )
    assert list(tmp_path.iterdir()) == [], "out=None writes nothing"
    assert 0.5 < result.summary["accuracy"] <= 1 and result.summary["ari"] == 1.0
    assert [m["round"] for m in result.metrics] == list(range(1, 21))
    assert result.labels.shape == (8,) and len(set(result.labels[:4])) == 1 and result.labels[0] != result.labels[4]
    assert set(result.models) == {"global", *(f"cluster {k}" for k in sorted(set(result.labels.tolist())))}
    fresh = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(result.models[f"cluster {result.labels[4]}"])  # loads into the user's module
    x, y = test[4]
    acc = (fresh(torch.as_tensor(x)).argmax(1).numpy() == y).mean()
    assert acc > 0.5


def test_in_memory_equals_on_disk_number_for_number(tmp_path):
    cfg = {"algorithm": {"name": "stocfl"}, "run": {"rounds": 6}, "train": {"epochs": 2, "lr": 0.1}}
    a = stocfl.run(cfg)
    b = stocfl.run(cfg, out=tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(a.metrics) == strip(b.metrics) == strip(rows)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["accuracy"] == a.summary["accuracy"]
    assert np.array_equal(a.labels, b.labels)


def test_a_custom_federation_run_on_disk_resumes_from_python_only(tmp_path, capsys):
    train, test, groups = rotated_clients()
    fed = stocfl.Federation.from_arrays(train, test, groups)
    cfg = {"algorithm": {"name": "fedavg"}, "run": {"rounds": 3}}
    stocfl.run(cfg, federation=fed, out=tmp_path / "r")
    assert main(["resume", str(tmp_path / "r")]) == 2
    assert "stocfl.resume" in capsys.readouterr().err
    again = stocfl.resume(tmp_path / "r", federation=fed)
    assert again.summary["rounds_done"] == 3


def test_a_python_run_resumes_only_on_the_same_federation_and_model(tmp_path):
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    train, test, groups = rotated_clients()

    def module(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

    cfg = {"algorithm": {"name": "stocfl"}, "run": {"rounds": 4, "sample_rate": 0.5}}
    whole = stocfl.run(cfg, federation=stocfl.Federation.from_arrays(train, test, groups), model=module(0))
    Experiment.create(
        configure.validate(cfg),
        tmp_path / "r",
        federation=stocfl.Federation.from_arrays(train, test, groups),
        module=module(0),
    ).run(progress=False, stop_after=2)
    # other data, another w_0, another architecture: each continued the run silently on what it was given
    other = [(x[..., ::-1].copy(), y) for x, y in train]  # mirrored images
    for fed, m, message in [
        (stocfl.Federation.from_arrays(other, test, groups), module(0), "the federation given"),
        (stocfl.Federation.from_arrays(train, test, groups, holdout=[0]), module(0), "federation"),
        (stocfl.Federation.from_arrays(train, test, groups), module(1), "initial weights w_0"),
        (
            stocfl.Federation.from_arrays(train, test, groups),
            nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.Linear(4, 10)),
            "the model given",
        ),
    ]:
        with pytest.raises(stocfl.UserError, match=message):
            stocfl.resume(tmp_path / "r", federation=fed, model=m)
    # the same arrays and the same seeded module, built anew (as in a new process): the run it would have been
    again = stocfl.resume(
        tmp_path / "r", federation=stocfl.Federation.from_arrays(train, test, groups), model=module(0)
    )
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(again.metrics) == strip(whole.metrics)


def test_registered_names_work_from_a_toml_config(tmp_path):
    train, test, groups = rotated_clients()

    def loader(data_dir):
        x = np.concatenate([x for x, _ in train])
        y = np.concatenate([y for _, y in train])
        xt = np.concatenate([x for x, _ in test])
        yt = np.concatenate([y for _, y in test])
        return x, y, xt, yt

    def halves(dataset, n_clients, per_client, test_per_client, seed, alpha):
        n = len(dataset.y_train) // n_clients
        m = len(dataset.y_test) // n_clients
        return stocfl.Federation.from_arrays(
            [(dataset.x_train[i * n : (i + 1) * n], dataset.y_train[i * n : (i + 1) * n]) for i in range(n_clients)],
            [(dataset.x_test[i * m : (i + 1) * m], dataset.y_test[i * m : (i + 1) * m]) for i in range(n_clients)],
            groups=[i * 2 // n_clients for i in range(n_clients)],
        )

    stocfl.register_dataset("my_digits", loader)
    stocfl.register_model(
        "tiny",
        lambda shape, n_classes, hidden: nn.Sequential(
            nn.Flatten(), nn.Linear(int(np.prod(shape)), hidden), nn.Tanh(), nn.Linear(hidden, n_classes)
        ),
    )
    stocfl.register_scenario("halves", halves)
    path = tmp_path / "mine.toml"
    path.write_text(
        '[run]\nrounds = 3\n[scenario]\nname = "halves"\ndataset = "my_digits"\nn_clients = 4\n'
        '[model]\nname = "tiny"\nhidden = 16\n[algorithm]\nname = "fedavg"\n'
    )
    result = stocfl.run(path)
    assert result.summary["dataset"] == "my_digits" and result.summary["n_clients"] == 4
    assert set(result.models["global"]) == {"1.weight", "1.bias", "3.weight", "3.bias"}
    assert result.models["global"]["1.weight"].shape == (16, 64)
    assert main(["run", str(path), "--out", str(tmp_path / "cli"), "--quiet"]) == 0  # the CLI, same process


@dataclasses.dataclass
class Mine:  # a task kind of a user's, for the registry's refusals
    client: int


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t, s: stocfl.Federation.from_arrays(t, s[:-1]), "give one of each per client"),
        (lambda t, s: stocfl.Federation.from_arrays([(t[0][0], t[0][1][:-1])] + t[1:], s), "client 0 train"),
        (lambda t, s: stocfl.Federation.from_arrays(t, s, n_classes=5), "outside 0..4"),
        (lambda t, s: stocfl.Federation.from_arrays([(t[0][0] * np.nan, t[0][1])] + t[1:], s), "NaN"),
        (lambda t, s: stocfl.Federation.from_arrays([(t[0][0][:, :, :4], t[0][1])] + t[1:], s), "different shapes"),
        (lambda t, s: stocfl.Federation.from_arrays(t, s, groups=[0, 1]), "groups must be 8 integers"),
        (lambda t, s: stocfl.Federation.from_arrays([(t[0][0], -t[0][1] - 1)] + t[1:], s), "negative"),
        (lambda t, s: stocfl.Federation.from_arrays([t[0][0]] + t[1:], s), "must be a pair"),
        (lambda t, s: stocfl.Federation.from_arrays(t, s, n_classes="10"), "n_classes = '10'; expected an integer"),
        (lambda t, s: stocfl.Federation.from_arrays(t, s, n_classes=10.5), "n_classes = 10.5"),  # was truncated to 10
        (lambda t, s: stocfl.Federation.from_arrays(t, s, holdout=[-1]), "holdout must be client ids in 0..7"),
        (lambda t, s: _from_items(t, s, label=lambda y: y + 0.5), "labels must be whole numbers"),  # was truncated
        (lambda t, s: _from_items(t, s, label=lambda y: [y, y]), "item 0's label has shape (2,)"),
        (lambda t, s: _from_items(t, s, label=lambda y: "cat"), "not arrays of numbers"),
        (lambda t, s: _from_items(t, s, item=lambda x, y: (x, y, 0)), "item 0 is not a pair (x, y)"),
        (lambda t, s: stocfl.run({"run": {"rounds": 0}}), "config: run.rounds"),
        (lambda t, s: stocfl.run({"algorithm": {"name": "stocfl", "tau": 3}}), "config: algorithm.tau"),
        (lambda t, s: stocfl.run(42), "config: expected a TOML path"),
        (lambda t, s: stocfl.run(None, model="mlp"), "model: expected a torch.nn.Module"),
        # the federation's clients replace [scenario]: these ran without holding out, on the federation's clients
        (
            lambda t, s: stocfl.run({"scenario": {"holdout": 0.25}}, federation=stocfl.Federation.from_arrays(t, s)),
            "scenario.holdout = 0.25 has no effect with a federation given in Python",
        ),
        (
            lambda t, s: stocfl.run({"scenario": {"n_clients": 100}}, federation=stocfl.Federation.from_arrays(t, s)),
            "scenario.n_clients = 100 has no effect",
        ),
        (
            lambda t, s: stocfl.run({"model": {"hidden": 64}}, model=nn.Sequential(nn.Flatten(), nn.Linear(64, 10))),
            "model.hidden = 64 has no effect with a model given in Python, which replaces [model]",
        ),
        (
            lambda t, s: stocfl.run(
                None,
                federation=stocfl.Federation.from_arrays(t, s),
                model=nn.Sequential(nn.Flatten(), nn.Linear(10, 10)),
            ),
            "does not fit",
        ),
        (lambda t, s: stocfl.register_model("auto", lambda *a: None), "identifier other than 'auto'"),
        # a user's "fedavg" (or "mlp", "digits", ...) would be reported under the built-in's name
        (lambda t, s: stocfl.register_model("mlp", lambda *a: None), "register_model: 'mlp' is built in"),
        (lambda t, s: stocfl.register_dataset("digits", lambda d: None), "register_dataset: 'digits' is built in"),
        (lambda t, s: stocfl.register_scenario("rotated", lambda *a: None), "register_scenario: 'rotated' is built in"),
        (lambda t, s: stocfl.register_algorithm(type("Mine", (FedAvg,), {"name": "fedavg"})), "'fedavg' is built in"),
        (
            lambda t, s: stocfl.register_engine(stocfl.Engine("batched", "mine", executor=lambda *a: None)),
            "register_engine: 'batched' is built in",
        ),
        (
            lambda t, s: stocfl.register_task(Train, Trained, lambda data, task: None),
            "register_task: 'Train' is built in",
        ),
        (lambda t, s: stocfl.register_task(int, Trained, lambda data, task: None), "must be dataclasses"),
        (
            lambda t, s: stocfl.register_task(Mine, Trained, lambda data, task: None, message="mine.task"),
            "message type 'mine.task' is not CATEGORY.ACTION",
        ),
        (
            lambda t, s: stocfl.register_task(Mine, Trained, lambda data, task: None, message="query.my-task"),
            "message type 'query.my-task' is not CATEGORY.ACTION",
        ),
        (lambda t, s: stocfl.run({"scenario": {"dataset": "nope"}}), "config: scenario.dataset: unknown data set"),
    ],
)
def test_bad_input_is_one_user_error_line(make, message):
    train, test, _ = rotated_clients()
    with pytest.raises(stocfl.UserError) as err:
        make(train, test)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def _from_items(train, test, label=lambda y: y, item=lambda x, y: (x, y)):
    """from_datasets over plain lists of items, each label as ``label`` makes it."""
    return stocfl.Federation.from_datasets(
        [[item(x[j], label(int(y[j]))) for j in range(len(y))] for x, y in train],
        [[item(x[j], int(y[j])) for j in range(len(y))] for x, y in test],
    )


def test_from_datasets_equals_from_arrays():
    from torch.utils.data import TensorDataset

    train, test, groups = rotated_clients()
    a = stocfl.Federation.from_arrays(train, test, groups)
    b = stocfl.Federation.from_datasets(
        [TensorDataset(torch.as_tensor(x), torch.as_tensor(y)) for x, y in train],
        [TensorDataset(torch.as_tensor(x), torch.as_tensor(y)) for x, y in test],
        groups,
    )
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert np.array_equal(a.train_offsets, b.train_offsets) and a.n_classes == b.n_classes == 10


def test_a_users_loss_trains_and_evaluates_on_both_executors(tmp_path, capsys):
    import torch.nn.functional as F

    smooth = lambda logits, y: F.cross_entropy(logits, y, reduction="none", label_smoothing=0.2)  # noqa: E731
    plain_ce = lambda logits, y: F.cross_entropy(logits, y, reduction="none")  # noqa: E731
    cfg = {"algorithm": {"name": "fedavg"}, "run": {"rounds": 3, "engine": "sequential"}, "train": {"lr": 0.1}}
    default = stocfl.run(cfg)
    same = stocfl.run(cfg, loss=plain_ce)
    seq = stocfl.run(cfg, loss=smooth)
    bat = stocfl.run({**cfg, "run": {"rounds": 3, "engine": "batched"}}, loss=smooth)
    w = lambda r: torch.cat([t.reshape(-1) for t in r.models["global"].values()])  # noqa: E731
    assert torch.allclose(w(default), w(same), atol=1e-6), "cross-entropy given as a function: the same model"
    assert not torch.allclose(w(default), w(seq), atol=1e-4), "the user's loss is the one trained"
    assert torch.allclose(w(seq), w(bat), atol=1e-5)
    assert seq.metrics[-1]["accuracy"] == bat.metrics[-1]["accuracy"]
    stocfl.run(cfg, loss=smooth, out=tmp_path / "r")
    assert main(["resume", str(tmp_path / "r")]) == 2 and "loss=" in capsys.readouterr().err
    with pytest.raises(stocfl.UserError, match="the loss given is not the one the run started on"):
        stocfl.resume(tmp_path / "r", loss=plain_ce, overrides=["run.rounds=4"])  # continued with cross-entropy
    again = lambda logits, y: F.cross_entropy(logits, y, reduction="none", label_smoothing=0.2)  # noqa: E731
    assert stocfl.resume(tmp_path / "r", loss=again, overrides=["run.rounds=4"]).summary["rounds_done"] == 4
    for bad, message in [
        (lambda logits, y: logits.sum(), "one value per sample"),
        (lambda logits, y: 1 / 0, "ZeroDivisionError"),
        ("ce", "expected a function"),
    ]:
        with pytest.raises(stocfl.UserError, match=message):
            stocfl.run(cfg, loss=bad)


def test_a_run_resumes_only_on_the_data_it_started_on(tmp_path):
    # a data directory holding another copy of the data set continued the run on it, without a word
    from stocfl.experiment import configure
    from stocfl.experiment.loop import Experiment

    digits = load_dataset("digits")
    copy = {"x_train": digits.x_train.clone()}
    stocfl.register_dataset("my_copy", lambda data_dir: (copy["x_train"], digits.y_train, digits.x_test, digits.y_test))
    cfg = configure.validate({"scenario": {"dataset": "my_copy"}, "run": {"rounds": 3}})
    Experiment.create(cfg, tmp_path / "r").run(progress=False, stop_after=1)
    copy["x_train"] = digits.x_train.flip(-1)  # another copy: the images mirrored
    with pytest.raises(stocfl.UserError, match="differ from the data the run started on; point --data-dir"):
        stocfl.resume(tmp_path / "r")
    copy["x_train"] = digits.x_train.clone()
    assert stocfl.resume(tmp_path / "r").summary["rounds_done"] == 3
