"""FedAvg (McMahan et al., 2017)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import Field

from stocfl.algorithms.base import Algorithm, AskClients, Context, Params

CHAIN = (
    "train w in a chain, as the StoCFL authors' code does (Table 1): each sampled client, in client order, "
    "trains from the previous one's result and w <- the mean of the chain; not the paper's method"
)


class FedAvgParams(Params):
    chain: bool = Field(False, description=CHAIN)


class FedAvg(Algorithm):
    """Federated averaging.

    Server model w. Each round every sampled client i runs E epochs of local SGD from w; the
    server sets w <- sum_i |D_i| w_i / sum_i |D_i|.

    Parameters
    ----------
    chain : bool, default False
        Train w as the StoCFL authors' code does: client j of the round (in client order)
        starts from client j-1's model, and w <- the weighted mean of the chain's models.
    """

    name = "fedavg"
    Params: ClassVar[type[FedAvgParams]] = FedAvgParams
    params: FedAvgParams

    @dataclass
    class State:
        w: torch.Tensor  # the server model

    state: State

    def __init__(self, params: FedAvgParams, ctx: Context):
        super().__init__(params, ctx)
        self.state = self.State(ctx.init_weights.clone())

    def local_task(self, round_: int, client: int, start: torch.Tensor):
        return self.local_training(round_, client, start)

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        if self.params.chain:
            self.state.w = self.chain(sampled, lambda i, start: self.local_task(round_, i, start), self.state.w, ask)
        else:
            self.state.w = self.aggregate(
                ask([self.local_task(round_, i, self.state.w) for i in sampled]), self.state.w
            )
        return {}

    def global_model(self) -> torch.Tensor:
        return self.state.w
