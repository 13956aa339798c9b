"""stocfl: clustered federated learning (StoCFL and its baselines) on one client-task engine.

The Python API::

    import stocfl
    fed = stocfl.Federation.from_arrays(train=[(x0, y0), ...], test=[(xt0, yt0), ...])
    result = stocfl.run({"algorithm": {"name": "stocfl"}}, federation=fed)

Names registered here (``register_dataset``, ``register_model``, ``register_scenario``,
``register_algorithm``, ``register_task``, ``register_engine``) are
then usable from a TOML config in the same process. Every input error is a ``UserError``.
"""

import stocfl.flower  # noqa: E402,F401  (registers the flower-sim engine)
from stocfl.algorithms import Algorithm, Context, register_algorithm
from stocfl.algorithms.base import Params
from stocfl.api import Comparison, Result, as_config, compare, resume, run, run_into
from stocfl.client.models import register_model
from stocfl.client.tasks import ClientData, register_task
from stocfl.config import Config
from stocfl.data.datasets import Dataset, register_dataset
from stocfl.data.federation import Federation
from stocfl.data.scenarios import register_scenario
from stocfl.errors import UserError
from stocfl.executors import Engine, register_engine
from stocfl.experiment.configure import load as load_config
from stocfl.experiment.modelfiles import export_models, load_model
from stocfl.experiment.provenance import config_digest
from stocfl.experiment.saved import LoadedRun, SavedRun, open_run

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "ClientData",
    "Comparison",
    "Config",
    "Context",
    "Dataset",
    "Engine",
    "Federation",
    "LoadedRun",
    "Params",
    "Result",
    "SavedRun",
    "UserError",
    "as_config",
    "compare",
    "config_digest",
    "export_models",
    "load_config",
    "load_model",
    "open_run",
    "register_algorithm",
    "register_dataset",
    "register_engine",
    "register_model",
    "register_scenario",
    "register_task",
    "resume",
    "run",
    "run_into",
    "__version__",
]
