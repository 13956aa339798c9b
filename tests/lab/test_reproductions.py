"""Each scenario's character shows in FedAvg's numbers (real MNIST, small federations)."""

import pytest

from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

pytestmark = pytest.mark.slow  # reproductions on real MNIST (make test-slow)

COMMON = [
    "scenario.dataset=mnist",
    "scenario.n_clients=40",
    "scenario.samples_per_client=200",
    "model.name=mlp",
    "run.rounds=20",
    "run.sample_rate=0.5",
    "train.epochs=2",
    "train.batch_size=20",
    "train.lr=0.05",
]


def _fedavg(tmp_path, data_dir, scenario):
    cfg = configure.load(overrides=COMMON + [f"scenario.name={scenario}"], data_dir=str(data_dir))
    return Experiment.create(cfg, tmp_path / scenario).run(progress=False)


def test_shifted_labels_cap_a_single_model_near_a_quarter(tmp_path, data_dir):
    # four label maps for the same images: one model is right for at most one of them (25%)
    s = _fedavg(tmp_path, data_dir, "shifted")
    assert 0.18 <= s["accuracy"] <= 0.35, s


def test_rotated_a_single_model_does_clearly_better_than_chance(tmp_path, data_dir):
    s = _fedavg(tmp_path, data_dir, "rotated")
    assert s["accuracy"] >= 0.45, s
