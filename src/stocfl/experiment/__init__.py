"""A run of an experiment: build it from a config, the round loop, provenance and resume, results,
metrics and plots, new clients, model files, comparisons."""

from stocfl.experiment.build import build_federation
from stocfl.experiment.compare import run_or_reuse
from stocfl.experiment.configure import load as load_config
from stocfl.experiment.configure import settle
from stocfl.experiment.loop import Experiment
from stocfl.experiment.metrics import cluster_numbers, clustering_scores
from stocfl.experiment.modelfiles import export_models, load_model
from stocfl.experiment.plots import integer_rounds
from stocfl.experiment.provenance import STATE_FILES, config_digest, finished_summary, shed_state
from stocfl.experiment.saved import LoadedRun, SavedRun, open_run

__all__ = [
    "STATE_FILES",
    "Experiment",
    "LoadedRun",
    "SavedRun",
    "build_federation",
    "cluster_numbers",
    "clustering_scores",
    "config_digest",
    "export_models",
    "finished_summary",
    "load_config",
    "load_model",
    "integer_rounds",
    "open_run",
    "run_or_reuse",
    "settle",
    "shed_state",
]
