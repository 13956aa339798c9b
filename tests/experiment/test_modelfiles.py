"""stocfl export / stocfl.load_model: the exported models are the ones the run used."""

import csv
import json

import numpy as np
import pytest
import torch

import stocfl
from stocfl.cli import main
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment


@pytest.mark.parametrize("algorithm", ["stocfl", "fedavg", "ifca", "fesem", "fedem"])
def test_exported_models_give_each_client_the_accuracy_of_its_run(tmp_path, algorithm, capsys):
    out = tmp_path / "r"
    cfg = configure.load(
        overrides=[f"algorithm.name={algorithm}", "scenario.n_clients=12", "run.rounds=2", "run.sample_rate=0.5"]
    )
    Experiment.create(cfg, out).run(progress=False)
    assert main(["export", str(out)]) == 0
    assert "global model:" in capsys.readouterr().out
    index = json.loads((out / "export" / "models.json").read_text())
    clusters = {m["cluster"]: m for m in index["models"] if m["model"] == "cluster"}
    fed = Experiment.open(out).fed
    for row in csv.DictReader((out / "clients.csv").open()):
        i, k, used = int(row["client"]), int(row["cluster"]), row["model"]
        if k >= 0:
            assert i in clusters[k]["clients"] if clusters else (algorithm, k) == ("fedavg", 0)
        if algorithm == "stocfl":  # StoCFL evaluates a placed client with its own cluster's model
            assert used == (f"cluster {k}" if k >= 0 else "global")
        if used == "mixture":  # FedEM's: its own weights over the exported components, in models.json
            assert algorithm == "fedem" and sorted(clusters) == [0, 1, 2]
            lo, hi = fed.test_offsets[i], fed.test_offsets[i + 1]
            with torch.no_grad():
                p = sum(
                    weight
                    * torch.softmax(stocfl.load_model(out / "export", cluster=int(f[8:-12]))(fed.x_test[lo:hi]), 1)
                    for f, weight in index["mixtures"][str(i)].items()
                )
            correct = (p.argmax(1) == fed.y_test[lo:hi]).float().mean().item()
            assert correct == pytest.approx(float(row["accuracy"]), abs=1e-6), (i, k)
            continue
        if used == "global":
            module = stocfl.load_model(out)  # the run directory finds its export/
        else:
            module = stocfl.load_model(out / "export", cluster=int(used.split()[1]))
        lo, hi = fed.test_offsets[i], fed.test_offsets[i + 1]
        with torch.no_grad():
            correct = (module(fed.x_test[lo:hi]).argmax(1) == fed.y_test[lo:hi]).float().mean().item()
        assert correct == pytest.approx(float(row["accuracy"]), abs=1e-6), (i, k)
    glob = stocfl.load_model(out)
    assert all(isinstance(t, torch.Tensor) for t in glob.state_dict().values())


def test_ifca_models_that_no_client_chose_are_exported_after_the_found_ones(tmp_path):
    out = tmp_path / "r"
    cfg = configure.load(
        overrides=[
            "algorithm.name=ifca",
            "algorithm.n_models=6",
            "scenario.n_clients=8",
            "run.rounds=1",
            "run.sample_rate=0.25",
        ]
    )
    Experiment.create(cfg, out).run(progress=False)
    index = json.loads((stocfl.export_models(out) / "models.json").read_text())
    numbers = [m["cluster"] for m in index["models"] if m["model"] == "cluster"]
    assert numbers == list(range(6))
    members = [m["members"] for m in index["models"] if m["model"] == "cluster"]
    assert all(members[: np.count_nonzero(members)]) and not any(members[np.count_nonzero(members) :])


def test_bad_export_requests_are_refused_in_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "none")]) == 2
    assert "holds no run" in capsys.readouterr().err
    with pytest.raises(stocfl.UserError, match="holds no exported models"):
        stocfl.load_model(tmp_path)
    out = tmp_path / "r"
    Experiment.create(configure.load(overrides=["scenario.n_clients=6", "run.rounds=1"]), out).run(progress=False)
    stocfl.export_models(out)
    with pytest.raises(stocfl.UserError, match="cluster 3 is not among the exported models"):
        stocfl.load_model(out, cluster=3)
    (out / "export" / "global.safetensors").write_bytes(b"abc")  # truncated
    with pytest.raises(stocfl.UserError, match="global.safetensors: cannot load it into model"):
        stocfl.load_model(out)
    for text in ("{bad", "[]", '{"models": 3}'):
        (out / "export" / "models.json").write_text(text)
        with pytest.raises(stocfl.UserError, match="is not an index stocfl export wrote"):
            stocfl.load_model(out, cluster=0)


def test_an_export_into_the_directory_of_an_earlier_one_removes_its_files_that_it_does_not_write(tmp_path):
    models = tmp_path / "models"
    ifca, fedavg = tmp_path / "ifca", tmp_path / "fedavg"
    Experiment.create(
        configure.load(
            overrides=["algorithm.name=ifca", "algorithm.n_models=3", "scenario.n_clients=6", "run.rounds=1"]
        ),
        ifca,
    ).run(progress=False)
    Experiment.create(configure.load(overrides=["scenario.n_clients=6", "run.rounds=1"]), fedavg).run(progress=False)
    stocfl.export_models(ifca, models)
    (models / "notes.txt").write_text("the user's")
    assert (models / "cluster_2.safetensors").is_file()
    stocfl.export_models(fedavg, models)  # FedAvg has no cluster models: IFCA's three would be left as if its own
    assert sorted(p.name for p in models.iterdir()) == ["global.safetensors", "models.json", "notes.txt"]


def test_a_model_registered_in_the_runs_process_must_be_registered_again_to_load(tmp_path):
    from torch import nn

    from stocfl.client import models

    stocfl.register_model("tiny_for_export", lambda shape, k, hidden: nn.Sequential(nn.Flatten(), nn.Linear(64, k)))
    out = tmp_path / "r"
    stocfl.run({"model": {"name": "tiny_for_export"}, "run": {"rounds": 1}}, out=out)
    stocfl.export_models(out)
    factory = models.MODELS.pop("tiny_for_export")  # as in a new process
    with pytest.raises(stocfl.UserError, match="must be registered again before loading"):
        stocfl.load_model(out)
    stocfl.register_model("tiny_for_export", factory)
    assert isinstance(stocfl.load_model(out)[1], nn.Linear)
