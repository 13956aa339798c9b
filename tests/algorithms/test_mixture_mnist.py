"""The mixture family on real MNIST: under concept shift (configs/concept_shift_mnist.toml: four
label permutations, 400 clients x 50, 10% a round): each client's dominant component is its
group and the mixture beats one global model (the soft-clustering issue's check); and on clients
that are mixtures of rotations (configs/rotated_mixture_mnist.toml), FedSoft finds the shares."""

import pytest

from stocfl.experiment import configure
from stocfl.experiment.loop import Experiment

pytestmark = pytest.mark.slow  # 100 rounds of 4 components: minutes (make test-slow)


def test_fedem_finds_the_four_concepts_and_beats_fedavg(tmp_path, data_dir):
    def run(name):
        cfg = configure.load("concept_shift_mnist", overrides=[f"algorithm.name={name}"], data_dir=str(data_dir))
        return Experiment.create(cfg, tmp_path / name).run(progress=False)

    fedem, fedavg = run("fedem"), run("fedavg")
    assert fedem["ari"] >= 0.9 and fedem["n_clusters"] == 4, fedem
    assert fedem["accuracy"] > fedavg["accuracy"] + 0.2, (fedem["accuracy"], fedavg["accuracy"])


def test_fedsoft_finds_each_clients_mixture_of_rotations(tmp_path, data_dir):
    """configs/rotated_mixture_mnist.toml, 20 rounds: FedSoft's importance weights come within
    0.15 in total variation of each client's true shares of the four rotations (measured 0.099
    at round 20, 0.116 at 50), where one global model is as far as the clients' other shares
    (FedAvg: 1 minus each client's share of the rotation its model stands for)."""

    def run(name, *extra):
        over = [f"algorithm.name={name}", "run.rounds=20", *extra]
        cfg = configure.load("rotated_mixture_mnist", overrides=over, data_dir=str(data_dir))
        return Experiment.create(cfg, tmp_path / name).run(progress=False)

    soft, fedavg = run("fedsoft"), run("fedavg")
    assert soft["mixture_tv"] < 0.15 and fedavg["mixture_tv"] > 0.4, (soft["mixture_tv"], fedavg["mixture_tv"])
    assert soft["n_clusters"] == 4 and soft["ari"] >= 0.6, soft
