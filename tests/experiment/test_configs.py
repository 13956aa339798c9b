import pytest

from stocfl.experiment import configure
from tests.helpers import REPO

CONFIGS = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    configure.load(path)


@pytest.mark.long
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_build_their_federation(path, data_dir):
    from stocfl.experiment.build import build_federation

    cfg = configure.load(path, data_dir=str(data_dir))
    fed = build_federation(cfg)
    assert fed.n_clients == cfg.scenario.n_clients
