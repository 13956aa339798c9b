"""FedAvg (McMahan et al., 2017)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stocfl.algorithms.base import Algorithm, Context, Params, RunTasks


class FedAvg(Algorithm):
    """Federated averaging.

    Server model w. Each round every sampled client i runs E epochs of local SGD from w; the
    server sets w <- sum_i |D_i| w_i / sum_i |D_i|. No parameters beyond ``[train]``.
    """

    name = "fedavg"

    @dataclass
    class State:
        w: torch.Tensor  # the server model

    def __init__(self, params: Params, ctx: Context):
        super().__init__(params, ctx)
        self.state = self.State(ctx.init_weights.clone())

    def local_task(self, round_: int, client: int):
        return self.local_training(round_, client, self.w)

    def round(self, round_: int, sampled: list[int], run: RunTasks) -> dict[str, Any]:
        results = run([self.local_task(round_, i) for i in sampled])
        self.w = self.aggregate(results, self.w)
        return {}

    def global_model(self) -> torch.Tensor:
        return self.w
