"""Ditto (Li et al., 2021): fair and robust FL through personalization."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import ConfigDict, Field

from stocfl.algorithms.base import Algorithm, AskClients, Context, Params
from stocfl.bounds import MAX_WEIGHT
from stocfl.storage.store import ClientStore


class DittoParams(Params):
    model_config = ConfigDict(populate_by_name=True)
    lam: float = Field(
        0.1, ge=0, le=MAX_WEIGHT, alias="lambda", description="lambda: personal loss + (lambda/2)||v_i - w||^2"
    )


class Ditto(Algorithm):
    """Global w trained exactly as FedAvg; each client keeps a personal model v_i (initialised
    to w the first time it is sampled) trained on f_i(v) + (lambda/2)||v - w||^2 with the same
    mini-batch order. Clients are evaluated with v_i (w until first sampled).

    Parameters
    ----------
    lambda : float, default 0.1
    """

    name = "ditto"
    placement = "a new client has no personal model yet: it uses the global model (cluster 0)"
    Params = DittoParams
    params: DittoParams

    @dataclass
    class State:
        w: torch.Tensor  # the global model
        personal: ClientStore  # v_i of every client sampled so far

    state: State

    def __init__(self, params: DittoParams, ctx: Context):
        super().__init__(params, ctx)
        self.state = self.State(ctx.init_weights.clone(), ctx.store("ditto_personal", len(ctx.init_weights)))

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        tasks = []
        for i in sampled:
            v = self.state.personal.get(i) if i in self.state.personal else self.state.w
            tasks.append(self.local_training(round_, i, self.state.w))
            tasks.append(self.local_training(round_, i, v, prox_center=self.state.w, prox_weight=self.params.lam))
        results = ask(tasks)
        ws, vs = results[0::2], results[1::2]
        self.state.w = self.aggregate(ws, self.state.w)
        self.state.personal.write({i: r.weights for i, r in zip(sampled, vs)})
        return {}

    def global_model(self) -> torch.Tensor:
        return self.state.w

    def client_models(self, clients, ask):
        return [self.state.personal.get(i) if i in self.state.personal else self.state.w for i in clients]
