"""Data in: data sets, the federation of clients, the scenarios that build one."""

from stocfl.data.datasets import Dataset, data_root, load_dataset, register_dataset, resolve_data_dir
from stocfl.data.drift import Drift
from stocfl.data.federation import Federation
from stocfl.data.scenarios import build, register_scenario

__all__ = [
    "Dataset",
    "Drift",
    "Federation",
    "build",
    "data_root",
    "load_dataset",
    "register_dataset",
    "register_scenario",
    "resolve_data_dir",
]
