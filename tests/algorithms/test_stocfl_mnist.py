"""StoCFL on real MNIST: the clustering checks of the StoCFL issue."""

import json

import pytest

from stocfl.cli import main
from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

pytestmark = pytest.mark.long  # whole runs on real data or the lab's tables (left out of make test-fast)

SIZES = {"pathological": (400, 50), "rotated": (400, 50), "shifted": (400, 50), "hybrid": (80, 40)}


def _stocfl(tmp_path, data_dir, scenario, extra=()):
    n, d = SIZES[scenario]
    cfg = configure.load(
        overrides=[
            "algorithm.name=stocfl",
            "scenario.dataset=mnist",
            f"scenario.name={scenario}",
            f"scenario.n_clients={n}",
            f"scenario.samples_per_client={d}",
            "model.name=mlp",
            "run.rounds=50",
            "run.sample_rate=0.1",
            "run.eval_every=25",
            "train.epochs=1",
            "train.batch_size=0",
            "train.lr=0.1",
            *extra,
        ],
        data_dir=str(data_dir),
    )
    return Experiment.create(cfg, tmp_path / scenario).run(progress=False)


@pytest.mark.slow  # test_groups_found_within_50_rounds[dim=1024] covers it at full size
def test_rotated_mnist_groups_found_with_projection(tmp_path, data_dir):
    s = _stocfl(tmp_path, data_dir, "rotated", ["algorithm.dim=1024", "scenario.n_clients=200", "run.rounds=30"])
    assert s["ari"] >= 0.99 and s["n_clusters"] == 4, s


@pytest.mark.slow
@pytest.mark.parametrize("dim", [0, 1024])
@pytest.mark.parametrize("scenario", list(SIZES))
def test_groups_found_within_50_rounds(tmp_path, data_dir, scenario, dim):
    s = _stocfl(tmp_path, data_dir, scenario, [f"algorithm.dim={dim}"])
    print(
        json.dumps(
            {
                "scenario": scenario,
                "dim": dim,
                "ari": s["ari"],
                "clusters": s["n_clusters"],
                "accuracy": s["accuracy"],
                "global_accuracy": s["global_accuracy"],
            }
        )
    )
    assert s["ari"] >= 0.99, s


def test_heldout_rotated_clients_join_their_rotation(tmp_path, data_dir, capsys):
    s = _stocfl(tmp_path, data_dir, "rotated", ["scenario.holdout=0.3", "run.rounds=30"])
    assert s["heldout"]["clients"] == 120 and s["heldout"]["in_true_group_cluster"] >= 0.95, s
    assert main(["assign", str(tmp_path / "rotated"), "--data-dir", str(data_dir)]) == 0
    placed = json.loads(capsys.readouterr().out.splitlines()[0])
    assert placed == s["heldout"]
