import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (`make test` runs `-n auto`), worker i of n keeps cores i, i+n, ...:
    each run inside it then sets as many torch threads as cores it may use (run.threads = 0), so
    workers never oversubscribe the machine (that made a prototype 7-9x slower). Processes a test
    starts (CLI runs, Flower SuperNodes) inherit the worker's cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not (worker and count and hasattr(os, "sched_setaffinity")):
        return
    cores = sorted(os.sched_getaffinity(0))
    i, n = int(worker.removeprefix("gw")), int(count)
    os.sched_setaffinity(0, cores[i::n] or [cores[i % len(cores)]])  # more workers than cores: one each


_pin_xdist_worker()

# the longest tests (minutes of waiting on Flower processes) are handed out first, so that under
# pytest-xdist they run beside the short ones instead of after them
FIRST = ("test_flower_deployment.py", "test_flower.py", "test_batchnorm.py", "test_stocfl_mnist.py")


def pytest_collection_modifyitems(items) -> None:
    rank = {name: k for k, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))


def find_data_dir() -> Path | None:
    """$STOCFL_DATA_DIR, else ../shared/data beside the project, else /work/shared/data."""
    for d in (os.environ.get("STOCFL_DATA_DIR"), ROOT.parent / "shared" / "data", "/work/shared/data"):
        if d and (Path(d) / "mnist" / "train-images-idx3-ubyte.gz").is_file():
            return Path(d)
    return None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    d = find_data_dir()
    if d is None:
        pytest.skip("real data not found: set STOCFL_DATA_DIR to a copy of ../shared/data")
    return d


# Property-based tests: a fast profile in the suite, a long search on demand
# (HYPOTHESIS_PROFILE=long: thousands of examples).
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=150, derandomize=True, print_blob=True)
settings.register_profile("long", max_examples=5000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
