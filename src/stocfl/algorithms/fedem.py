"""FedEM: federated multi-task learning under a mixture of distributions (Marfoq et al., NeurIPS 2021)."""

from __future__ import annotations

import dataclasses
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
    Placement,
    check_models_fit,
    dominant_labels,
    mean_model,
    store_shares,
)
from stocfl.client.mixture import Mixture, MixtureTrain
from stocfl.client.tasks import Trained, task_seed
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore

NEW_CLIENT_EM_STEPS = 50  # E-steps a new client iterates on the fixed components to find its weights


class FedEMParams(Params):
    n_components: int = Field(3, ge=1, le=100, description="M: number of shared component models")


class FedEM(Algorithm):
    """M component models shared by all clients; every client i keeps its mixture weights pi_i
    (1/M each until it is first sampled). Each round every sampled client runs one EM step on
    its train data (:class:`~stocfl.client.mixture.MixtureTrain`): the E-step
    q_s(m) ~ pi_im exp(-l(h_m(x_s), y_s)) and pi_i <- mean_s q_s, then every component trains
    from the round's models as ``[train]`` says on the loss weighted by q_s(m). Component m
    becomes the mean of the clients' trained m, weighted by their samples (Algorithm 1's
    n_t / n, through the run's ``[aggregation]`` rule). A client predicts with its mixture
    sum_m pi_im softmax(h_m(x)).

    Settled where the paper leaves it open (docs/algorithms/fedem.md): the components start
    from independent initialisations (seeds seed+1 .. seed+M, as IFCA's models; the authors'
    code seeds learner m with seed + m); the E-step uses the client's train data; with partial
    participation a component is the mean over the round's sampled clients (the authors' code
    also counts the unsampled ones with the old model, which at a sample rate of 1 is the same).
    A client's found cluster is its dominant component argmax_m pi_im (-1 until sampled); the
    global model, which FedEM does not have, is the plain mean of the components (as IFCA's).
    A new client finds its weights by 50 E-steps on the fixed components (the paper's
    Section 5, unseen clients) and predicts with its mixture.

    Parameters
    ----------
    n_components : int, default 3
    """

    name = "fedem"
    placement = "its mixture weights over the components from E-steps on its train data; cluster: the dominant one"
    Params = FedEMParams
    params: FedEMParams
    models_key = "n_components"  # the parameter that counts the models

    @dataclass
    class State:
        components: list[torch.Tensor]  # the M shared component models
        mixture: ClientStore  # pi_i of every client sampled so far (N x M)

    state: State

    def __init__(self, params: FedEMParams, ctx: Context):
        super().__init__(params, ctx)
        if ctx.init_model is None:
            raise UserError(f"{self.name} needs Context.init_model (seed -> weights) to initialise its models")
        m = self.n_models
        check_models_fit(m + 1, ctx, self.models_key)  # the models and their stack, sent to clients
        self.state = FedEM.State(  # FedEM's own, which a subclass (FedRC) extends
            [ctx.init_model(ctx.seed + 1 + k) for k in range(m)],
            ctx.store(f"{self.name}_mixture", m),
        )

    @property
    def n_models(self) -> int:
        return self.params.n_components

    def weights_of(self, i: int) -> torch.Tensor:
        """pi_i: the client's weights over the models (1/M each until it is first sampled)."""
        m = self.n_models
        return self.state.mixture.get(i) if i in self.state.mixture else torch.full((m,), 1.0 / m)

    def label_bias(self) -> torch.Tensor | None:
        """A per-label term of the E-step, (M, C); FedEM has none (FedRC's -log P(y; k))."""
        return None

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        stack, bias = torch.stack(self.state.components), self.label_bias()
        results = ask(
            [
                MixtureTrain(i, stack, self.ctx.local, task_seed(self.ctx.seed, round_, i), self.weights_of(i), bias)
                for i in sampled
            ]
        )
        for k in range(self.n_models):
            trained = [Trained(r.models[k], r.n_samples) for r in results]
            self.state.components[k] = self.aggregate(trained, self.state.components[k])
        self.remember(sampled, results)
        # sampled clients per dominant model, and the mean entropy of their weights (log M:
        # undecided; 0: each client is one model)
        pis = torch.stack([r.mixture for r in results]).double()
        entropy = -(pis * torch.log(pis.clamp(min=1e-12))).sum(1)
        return {
            "dominant": np.bincount(pis.argmax(1).numpy(), minlength=self.n_models).tolist(),
            "mixture_entropy": round(float(entropy.mean()), 4),
        }

    def remember(self, sampled: list[int], results: list) -> None:
        """What the clients keep from the round: their new mixture weights."""
        self.state.mixture.write({i: r.mixture for i, r in zip(sampled, results)})

    def global_model(self) -> torch.Tensor:
        return mean_model(self.state.components)

    def client_models(self, clients, ask):
        stack = torch.stack(self.state.components)
        return [Mixture(stack, self.weights_of(i)) for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return dominant_labels(self.state.mixture)

    def assignments(self) -> np.ndarray:
        return store_shares(self.state.mixture)

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(enumerate(self.state.components))

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """Each new client's weights from E-steps on the fixed models (no training)."""
        stack = torch.stack(self.state.components)
        e_step_only = dataclasses.replace(self.ctx.local, epochs=0)
        bias = self.label_bias()
        results = ask([MixtureTrain(i, stack, e_step_only, 0, None, bias, NEW_CLIENT_EM_STEPS) for i in clients])
        return [
            Placement(i, int(r.mixture.argmax()), None, False, Mixture(stack, r.mixture))
            for i, r in zip(clients, results)
        ]
