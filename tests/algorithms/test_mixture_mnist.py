"""The mixture family on real MNIST under concept shift (configs/concept_shift_mnist.toml: four
label permutations, 400 clients x 50, 10% a round): each client's dominant component is its
group and the mixture beats one global model (the soft-clustering issue's check)."""

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
