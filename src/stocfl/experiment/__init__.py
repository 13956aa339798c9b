"""A run of an experiment: build it from a config, the round loop, provenance and resume, results,
metrics and plots, new clients, model files, comparisons."""

from stocfl.experiment.compare import run_or_reuse
from stocfl.experiment.loop import finished_summary
from stocfl.experiment.metrics import cluster_numbers, clustering_scores
from stocfl.experiment.plots import integer_rounds
from stocfl.experiment.saved import LoadedRun, SavedRun, open_run

__all__ = ["LoadedRun", "SavedRun", "cluster_numbers", "clustering_scores", "finished_summary", "integer_rounds", "open_run",
           "run_or_reuse"]
