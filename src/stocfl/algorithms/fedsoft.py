"""FedSoft: soft clustered federated learning with proximal local updating (Ruan and Joe-Wong, AAAI 2022)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pydantic import ConfigDict, Field

from stocfl.algorithms.base import (
    Algorithm,
    AskClients,
    Context,
    Params,
    Placement,
    check_models_fit,
    dominant_labels,
    mean_model,
    store_shares,
)
from stocfl.bounds import MAX_WEIGHT
from stocfl.client.mixture import MixtureTrain
from stocfl.client.tasks import Trained, task_seed
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore


class FedSoftParams(Params):
    model_config = ConfigDict(populate_by_name=True)
    n_clusters: int = Field(3, ge=1, le=100, description="S: number of cluster centres")
    lam: float = Field(
        0.1,
        ge=0,
        le=MAX_WEIGHT,
        alias="lambda",
        description="lambda: local loss + (lambda/2) sum_s u_is ||w_i - c_s||^2",
    )
    smoother: float = Field(1e-4, ge=0, lt=1, description="sigma: the share of a centre that fits none of the samples")


class FedSoft(Algorithm):
    """S cluster centres c_s shared by all clients, and a local model w_i that every client
    keeps. Each round every sampled client (Algorithm 1):

    1. estimates its importance weights u_is, the share of its train samples whose loss is
       least under centre s (a centre that fits none gets sigma; the weights normalised);
    2. trains w_i from its own w_i as ``[train]`` says on
       f_i(w) + (lambda/2) sum_s u_is ||w - c_s||^2,
       the proximal local updating, and sends w_i and u_i back.

    Centre s becomes sum_i v_si w_i over the round's clients, with the aggregation weights
    v_si = u_is n_i / sum_j u_js n_j (through the run's ``[aggregation]`` rule); a centre with
    no weight at all (sigma = 0 and no sample fits it) keeps its value. A client predicts with
    its own w_i; its cluster is argmax_s u_is.

    Settled where the paper leaves it open (docs/algorithms/fedsoft.md): the centres start from
    independent initialisations (seeds seed+1 .. seed+S, as FedEM's) and every local model from
    the run's w_0, as the authors' code starts each client from one shared initial model; the
    importance weights are estimated by each sampled client in its round (the authors' code's
    estimation interval tau = 1), and the round's clients are the run's sampler's: the paper's
    per-centre selection of clients by v_s would give FedSoft a participation the other methods
    do not have. The proximal term's gradient is lambda (w - sum_s u_is c_s), so the local step
    is FedProx's toward the u_i-weighted centre. A client not yet sampled, and a new client,
    estimate u on the fixed centres and predict with the centre of their largest share.

    Parameters
    ----------
    n_clusters : int, default 3
    lambda : float, default 0.1
        The authors' code's setting for MNIST and EMNIST (0.01 for CIFAR-10).
    smoother : float, default 1e-4
    """

    name = "fedsoft"
    placement = "the centre that fits most of its train samples; it predicts with that centre"
    Params = FedSoftParams
    params: FedSoftParams
    models_key = "n_clusters"

    @dataclass
    class State:
        centres: list[torch.Tensor]  # the S cluster centres c_s
        local: ClientStore  # w_i of every client sampled so far
        importance: ClientStore  # u_i of every client sampled so far (N x S)

    state: State

    def __init__(self, params: FedSoftParams, ctx: Context):
        super().__init__(params, ctx)
        if ctx.init_model is None:
            raise UserError(f"{self.name} needs Context.init_model (seed -> weights) to initialise its centres")
        s, p = params.n_clusters, len(ctx.init_weights)
        check_models_fit(s + 2, ctx, self.models_key)  # the centres, their stack and the local model sent
        self.state = self.State(
            [ctx.init_model(ctx.seed + 1 + k) for k in range(s)],
            ctx.store("fedsoft_local", p),
            ctx.store("fedsoft_importance", s),
        )

    def _own(self, i: int) -> torch.Tensor:
        return self.state.local.get(i) if i in self.state.local else self.ctx.init_weights

    def _task(
        self, i: int, stack: torch.Tensor, seed: int, local=None, own: torch.Tensor | None = None
    ) -> MixtureTrain:
        """The client's step: with ``own`` (its local model), the proximal training; without,
        the estimate of its importance weights alone."""
        return MixtureTrain(
            i,
            stack,
            self.ctx.local if local is None else local,
            seed,
            assign="hard",
            smoother=self.params.smoother,
            personal=own,
            mu=self.params.lam if own is not None else 0.0,
        )

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        stack = torch.stack(self.state.centres)
        starts = [self._own(i) for i in sampled]  # where each local model trains from
        results = ask(
            [self._task(i, stack, task_seed(self.ctx.seed, round_, i), own=w) for i, w in zip(sampled, starts)]
        )
        trained = [Trained(r.models[0], r.n_samples) for r in results]
        u = torch.stack([r.mixture for r in results]).double()
        n = torch.tensor([r.n_samples for r in results], dtype=torch.float64)
        for s in range(self.params.n_clusters):
            v = (u[:, s] * n).tolist()
            if sum(v) > 0:  # else no client gives it weight: it keeps its value
                self.state.centres[s] = self.aggregate(trained, starts, weights=v)
        self.state.local.write({i: t.weights for i, t in zip(sampled, trained)})
        self.state.importance.write({i: r.mixture for i, r in zip(sampled, results)})
        return {"dominant": np.bincount(u.argmax(1).numpy(), minlength=self.params.n_clusters).tolist()}

    def global_model(self) -> torch.Tensor:
        return mean_model(self.state.centres)

    def _best_centres(self, clients: list[int], ask: AskClients) -> list[int]:
        """For clients FedSoft has not trained: the centre of their largest share (E-step only)."""
        if not clients:
            return []
        stack = torch.stack(self.state.centres)
        e_step_only = dataclasses.replace(self.ctx.local, epochs=0)
        results = ask([self._task(i, stack, 0, e_step_only) for i in clients])
        return [int(r.mixture.argmax()) for r in results]

    def client_models(self, clients, ask):
        new = [i for i in clients if i not in self.state.local]
        best = dict(zip(new, self._best_centres(new, ask)))
        return [self.state.local.get(i) if i not in best else self.state.centres[best[i]] for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return dominant_labels(self.state.importance)

    def assignments(self) -> np.ndarray:
        return store_shares(self.state.importance)

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(enumerate(self.state.centres))

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        best = self._best_centres(clients, ask)
        return [Placement(i, b, None, False, self.state.centres[b]) for i, b in zip(clients, best)]
