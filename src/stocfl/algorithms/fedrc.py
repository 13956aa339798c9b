"""FedRC: robust clustering for diverse distribution shifts (Guo, Tang and Lin, ICML 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import Field

from stocfl.algorithms.base import Context, Params
from stocfl.algorithms.fedem import FedEM
from stocfl.errors import UserError
from stocfl.storage.store import ClientStore

LABEL_FLOOR = 1e-8  # the least mass of a label in a cluster before normalising (the authors' code)


class FedRCParams(Params):
    n_clusters: int = Field(3, ge=1, le=100, description="K: number of cluster models")


class FedRC(FedEM):
    """K cluster models shared by all clients; every client keeps its weights pi_i over them.
    Each round every sampled client weighs each train sample for each cluster by the robust
    clustering rule (Algorithm 1):

        w_s(k) ~ pi_ik exp(-l(h_k(x_s), y_s)) / P(y_s; k),

    normalised over k, where P(y; k) is cluster k's label distribution: the mass of label y
    among the samples the clusters weigh, summed over the federation. Dividing by it keeps
    label shift (P(y) differs) and feature shift (P(x) differs) from pulling a client into a
    cluster of its own: only a different P(y | x), a concept shift, does. Then pi_i <- mean_s
    w_s, every cluster model trains from the round's model on the loss weighted by w_s(k), and
    cluster k becomes the mean of the clients' trained k weighted by their samples. A client
    predicts with its mixture sum_k pi_ik softmax(h_k(x)); its cluster is argmax_k pi_ik.

    Settled (docs/algorithms/fedrc.md): P(y; k) is formed from each client's latest label
    masses (sum_s w_s(k) [y_s = y], sent with its models), those of clients not sampled this
    round included, as the authors' code sums every client's; each entry is floored at 1e-8
    and the rows normalised (their code); before any client has reported, P is uniform and
    the rule is FedEM's E-step. Everything else (starts, aggregation, new clients, the store)
    is FedEM's (:class:`~stocfl.algorithms.fedem.FedEM`).

    Parameters
    ----------
    n_clusters : int, default 3
    """

    name = "fedrc"
    placement = "its weights over the clusters from the robust rule on its train data; cluster: the dominant one"
    Params = FedRCParams  # type: ignore[assignment]
    params: FedRCParams  # type: ignore[assignment]
    models_key = "n_clusters"

    @dataclass
    class State:
        components: list[torch.Tensor]  # the K cluster models
        mixture: ClientStore  # pi_i of every client sampled so far (N x K)
        label_mass: ClientStore  # each client's latest sum_s w_s(k) [y_s = y] (N x K*C)

    state: State  # type: ignore[assignment]

    def __init__(self, params: FedRCParams, ctx: Context):
        super().__init__(params, ctx)  # type: ignore[arg-type]
        k, c = self.n_models, ctx.n_classes
        if c < 1:
            raise UserError("fedrc needs Context.n_classes (its clusters' label distributions are over them)")
        labels = ctx.store("fedrc_labels", k * c)
        self.state = self.State(self.state.components, self.state.mixture, labels)

    @property
    def n_models(self) -> int:
        return self.params.n_clusters

    def label_bias(self) -> torch.Tensor | None:
        """-log P(y; k), (K, C); None before any client reported its label masses."""
        store = self.state.label_mass
        seen = np.flatnonzero(store.has)
        if not len(seen):
            return None
        mass = torch.from_numpy(np.asarray(store.rows[seen], dtype=np.float64).sum(0))
        p = mass.reshape(self.params.n_clusters, -1).clamp(min=LABEL_FLOOR)
        return -torch.log(p / p.sum(1, keepdim=True)).float()

    def remember(self, sampled: list[int], results: list) -> None:
        """The clients' new mixture weights, and their label masses for P(y; k)."""
        super().remember(sampled, results)
        self.state.label_mass.write({i: r.label_mass.reshape(-1) for i, r in zip(sampled, results)})
