"""stocfl: clustered federated learning (StoCFL and its baselines) on one client-task engine.

The Python API::

    import stocfl
    fed = stocfl.Federation.from_arrays(train=[(x0, y0), ...], test=[(xt0, yt0), ...])
    result = stocfl.run({"algorithm": {"name": "stocfl"}}, federation=fed)

Names registered here (``register_dataset``, ``register_model``, ``register_scenario``,
``register_algorithm``, ``register_task``, ``register_engine``) are
then usable from a TOML config in the same process. Every input error is a ``UserError``.
"""

from stocfl.algorithms import Algorithm, Context, register_algorithm
from stocfl.api import Result, as_config, resume, run, run_into
from stocfl.config import Config
from stocfl.data.datasets import Dataset, register_dataset
from stocfl.errors import UserError
from stocfl.executors import Engine, register_engine
from stocfl.experiment.loop import config_digest
from stocfl.experiment.saved import LoadedRun, SavedRun, open_run
from stocfl.experiment.modelfiles import export_models, load_model
from stocfl.client.models import register_model
from stocfl.data.federation import Federation
from stocfl.data.scenarios import register_scenario
from stocfl.client.tasks import ClientData, register_task
import stocfl.flower  # noqa: E402,F401  (registers the flower-sim engine)

__version__ = "0.1.0"

__all__ = ["Algorithm", "ClientData", "Config", "Context", "Dataset", "Engine", "Federation", "LoadedRun", "Result", "SavedRun", "UserError",
           "as_config", "config_digest", "export_models", "load_model", "open_run", "register_algorithm", "register_dataset", "register_engine", "register_model",
           "register_scenario", "register_task", "resume", "run", "run_into", "__version__"]
