"""IFCA: iterative federated clustering (Ghosh et al., 2020)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import Field

from stocfl.algorithms.base import (
    Algorithm,
    AskClients,
    Context,
    Params,
    check_models_fit,
    lowest_train_loss,
    mean_model,
    place_by_lowest_loss,
    train_losses,
)
from stocfl.errors import UserError


class IFCAParams(Params):
    n_models: int = Field(4, ge=1, le=1000, description="M: number of cluster models")
    share_layers: bool = Field(
        False, description="average all but the output layer over every client (the IFCA paper's weight sharing)"
    )


class IFCA(Algorithm):
    """M models initialised independently (seeds seed+1 .. seed+M). Each round every sampled
    client evaluates all M models on its TRAIN data, picks the lowest loss, trains that model
    and returns it; each model becomes the weighted mean of the returns that chose it, a model
    nobody chose keeps its weights. Evaluation: every client uses the model with the lowest
    train loss. ``share_layers``: all but the output layer are averaged over all returns.

    Parameters
    ----------
    n_models : int, default 4
    share_layers : bool, default False
    """

    name = "ifca"
    placement = "the cluster model with the lowest loss on the client's train data"
    Params = IFCAParams
    params: IFCAParams

    @dataclass
    class State:
        models: list[torch.Tensor]  # the M cluster models
        choice: np.ndarray  # latest choice of every client (-1: never sampled)

    state: State

    def __init__(self, params: IFCAParams, ctx: Context):
        super().__init__(params, ctx)
        if ctx.init_model is None:
            raise UserError("ifca needs Context.init_model (seed -> weights) to initialise its models independently")
        check_models_fit(params.n_models, ctx, "n_models")
        self.state = self.State(
            [ctx.init_model(ctx.seed + 1 + m) for m in range(params.n_models)],
            np.full(ctx.n_clients, -1, dtype=np.int64),
        )

    def choose(self, clients: list[int], ask: AskClients) -> list[int]:
        """argmin_m of the train loss of model m on each client (ties: the lower index)."""
        return lowest_train_loss(clients, self.state.models, ask)

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        losses = train_losses(sampled, self.state.models, ask)
        chosen = losses.argmin(axis=1).tolist()  # as choose(): the lowest train loss, ties the lower index
        self.state.choice[sampled] = chosen
        starts = [self.state.models[k] for k in chosen]
        results = ask([self.local_training(round_, i, w) for i, w in zip(sampled, starts)])
        for k in range(len(self.state.models)):
            mine = [r for r, c in zip(results, chosen) if c == k]
            if mine:
                self.state.models[k] = self.aggregate(mine, self.state.models[k])
        if self.params.share_layers:
            shared = self.aggregate(results, starts)
            end = self.ctx.n_trainable or len(shared)  # the output layer: the last parameters
            head = end - self.ctx.last_layer
            for w in self.state.models:
                w[:head] = shared[:head]
                w[end:] = shared[end:]  # buffers (BatchNorm statistics) are shared like the body
        # each model's mean train loss over the clients that chose it (None: nobody), before
        # training: where a model's own clients leave it (collapse), this says why
        picked = np.asarray(chosen)
        own = [losses[picked == k, k] for k in range(len(self.state.models))]
        return {
            "choices": np.bincount(picked, minlength=len(self.state.models)).tolist(),
            "model_loss": [round(float(o.mean()), 4) if o.size else None for o in own],
        }

    def global_model(self) -> torch.Tensor:
        # IFCA has no global model; the plain mean of the M models stands in for global_accuracy
        return mean_model(self.state.models)

    def client_models(self, clients, ask):
        return [self.state.models[k] for k in self.choose(clients, ask)]

    def cluster_labels(self) -> np.ndarray:
        return self.state.choice.copy()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(enumerate(self.state.models))

    def place_new(self, clients, ask):
        return place_by_lowest_loss(clients, dict(enumerate(self.state.models)), ask)
