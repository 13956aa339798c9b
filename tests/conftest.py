import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
