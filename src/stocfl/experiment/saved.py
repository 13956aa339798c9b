"""A results directory as another program reads it (the lab's reproductions and benchmark): its
config and digest, whether it finished, and the run rebuilt at its last checkpoint, to evaluate
its models in ways the run itself does not. Nothing here writes into the directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stocfl.client.mixture import Mixture, mixture_evaluated
from stocfl.client.tasks import evaluate_pooled
from stocfl.config import Config
from stocfl.data.federation import Federation
from stocfl.experiment import configure
from stocfl.experiment.build import read_config
from stocfl.experiment.loop import Experiment, client_models_in_parts
from stocfl.experiment.provenance import config_digest, finished_summary


class SavedRun:
    """The run in ``path``: its resolved :attr:`config`, :attr:`digest` and :attr:`finished`
    summary. A directory without a readable config.toml is a :class:`~stocfl.UserError`."""

    def __init__(self, path: str | Path, data_dir: str | None = None):
        self.path, self.data_dir = Path(path), data_dir
        self.config: Config = configure.validate(read_config(self.path, data_dir))

    def __repr__(self) -> str:
        c = self.config
        return (
            f"SavedRun({str(self.path)!r}: {c.algorithm['name']} on {c.scenario.name} ({c.scenario.dataset}), "
            f"{'finished' if self.finished else 'not finished'})"
        )

    @property
    def digest(self) -> str:
        """SHA-256 of the resolved config (the data directory left out): equal digests, same run."""
        return config_digest(self.config)

    @property
    def finished(self) -> dict[str, Any] | None:
        """The summary when the run has done every round of its config, else None."""
        return finished_summary(self.path)

    def load(self) -> LoadedRun:
        """The run rebuilt from its config and last checkpoint (its data read again)."""
        return LoadedRun(Experiment.open(self.path, self.data_dir))


class LoadedRun:
    """A saved run at its last checkpoint: its federation, its models, and evaluation of any
    weights on any data with the run's model."""

    def __init__(self, exp: Experiment):
        self._exp = exp
        self.federation: Federation = exp.fed

    def cluster_models(self) -> dict[int, torch.Tensor]:
        """The algorithm's cluster models by its own cluster id (empty: one global model)."""
        return self._exp.algorithm.cluster_models()

    def global_model(self) -> torch.Tensor:
        return self._exp.algorithm.global_model()

    def client_models(self, clients: list[int]) -> Iterator[tuple[list[int], list[torch.Tensor]]]:
        """(clients, the model each would use), a part at a time, so that Ditto's thousands of
        personal models are never held at once. One model object for clients that share one."""
        return client_models_in_parts(self._exp.algorithm, clients, self._exp.ask)

    def accuracy(self, weights: torch.Tensor | Mixture, x: torch.Tensor, y: torch.Tensor) -> float:
        """Accuracy of the run's model with ``weights`` (or a client's :class:`Mixture` of
        models) on the samples ``(x, y)``."""
        if isinstance(weights, Mixture):
            return mixture_evaluated(self._exp.model, weights, x, y).accuracy
        return evaluate_pooled(self._exp.model, weights, [(x, y)])[0].accuracy


def open_run(path: str | Path, data_dir: str | None = None) -> SavedRun:
    """The results directory ``path`` as a :class:`SavedRun` (``data_dir``: where its data is now)."""
    return SavedRun(path, data_dir)
