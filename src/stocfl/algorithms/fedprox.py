"""FedProx (Li et al., 2020)."""

from __future__ import annotations

from pydantic import Field

from stocfl.algorithms.fedavg import FedAvg, FedAvgParams
from stocfl.bounds import MAX_WEIGHT


class FedProxParams(FedAvgParams):
    mu: float = Field(0.01, ge=0, le=MAX_WEIGHT, description="proximal weight mu: local loss + (mu/2)||w_i - w||^2")


class FedProx(FedAvg):
    """FedAvg whose local loss adds (mu/2) ||w_i - w||^2 toward the round's global model w.

    Parameters
    ----------
    mu : float, default 0.01
        Proximal weight; mu = 0 is FedAvg.
    """

    name = "fedprox"
    Params = FedProxParams
    params: FedProxParams

    def local_task(self, round_: int, client: int, start):
        return self.local_training(round_, client, start, prox_center=self.state.w, prox_weight=self.params.mu)
