"""What a client computes: task kinds and their messages, local training, optimizers, models."""

from stocfl.client.descriptor import Describe, Described
from stocfl.client.flops import FlopCount
from stocfl.client.gradient import Gradient, Gradiented
from stocfl.client.mixture import EvaluateMixture, Mixture, MixtureTrain, MixtureTrained, evaluation_task
from stocfl.client.models import FlatModel, build_module, make_model, register_model
from stocfl.client.optim import Optimizer
from stocfl.client.split import SplitTrain, SplitTrained
from stocfl.client.subspace import Subspace, Subspaced
from stocfl.client.tasks import (
    ClientData,
    Evaluate,
    Evaluated,
    FactoredTrained,
    Train,
    Trained,
    evaluate_pooled,
    id_ranges,
    register_task,
    task_seed,
)
from stocfl.client.training import LocalTraining, local_sgd

__all__ = [
    "FlopCount",
    "ClientData",
    "Describe",
    "Described",
    "Evaluate",
    "EvaluateMixture",
    "Evaluated",
    "FactoredTrained",
    "FlatModel",
    "Gradient",
    "Gradiented",
    "LocalTraining",
    "Mixture",
    "MixtureTrain",
    "MixtureTrained",
    "Optimizer",
    "SplitTrain",
    "SplitTrained",
    "Subspace",
    "Subspaced",
    "Train",
    "Trained",
    "build_module",
    "evaluate_pooled",
    "evaluation_task",
    "id_ranges",
    "local_sgd",
    "make_model",
    "register_model",
    "register_task",
    "task_seed",
]
