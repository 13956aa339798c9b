"""What every algorithm shares: its context, local-training tasks, state for checkpoints.

An algorithm reads like its paper's pseudocode: each round it builds client tasks and hands
them to ``ask`` (whichever engine runs them), then aggregates the results. It never loops over data,
batches clients or sends messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from stocfl.algorithms.aggregation import Aggregator
from stocfl.bounds import MAX_MODEL_BYTES
from stocfl.client.mixture import Mixture
from stocfl.client.tasks import Evaluate, FactoredTrained, Reply, Task, Train, Trained, task_seed
from stocfl.client.training import LocalTraining
from stocfl.errors import UserError
from stocfl.storage import state as state_mod
from stocfl.storage.store import RAM, ClientStore

# what an algorithm is handed to ask clients for work: a task list in, one reply a task out (the
# runner's checked executor; a client that fails drops out of the round)
AskClients = Callable[[list[Task]], list[Reply]]
RunTasks = AskClients  # the name before 0.1.0


class Params(BaseModel):
    """Algorithm parameters: validated, strict, unknown keys rejected."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


@dataclass(frozen=True)
class Context:
    """What the server knows when it starts: N, w_0, how clients train (``local``: E, B and the
    optimizer with eta, the config's ``[train]``), the seed."""

    n_clients: int
    init_weights: torch.Tensor
    local: LocalTraining
    seed: int
    input_shape: tuple[int, ...] = ()
    n_classes: int = 0
    init_model: Callable[[int], torch.Tensor] | None = None  # seed -> fresh initial weights
    last_layer: int = 0  # entries of the output layer, the last of the parameters
    n_trainable: int = 0  # entries that are parameters (the rest: buffers such as BatchNorm's); 0 = all
    workdir: Path | None = None  # where per-client stores live (None: in memory)
    store_ram: int = RAM  # bytes a per-client store may take in memory with a workdir (run.store_ram)
    participants: tuple[int, ...] | None = None  # clients that may train (None: all); the rest are held out
    sample_size: int = 0  # clients sampled per round, m (0: not known)
    aggregator: Aggregator = Aggregator()  # how trained models are combined ([aggregation])
    drift_notice: bool = False  # clients' data may change, and they say so (Algorithm.drifted)
    present: Callable[[int], list[int]] | None = None  # round -> the participants present (None: all, always)

    def store(self, name: str, n_cols: int, n_rows: int = 0) -> ClientStore:
        """A per-client store of the run: ``n_rows`` (default N) rows of ``n_cols`` float32."""
        return ClientStore(n_rows or self.n_clients, n_cols, self.workdir, name, self.store_ram)

    @property
    def training_clients(self) -> list[int]:
        """The clients that take part in training: never a held-out one."""
        return list(range(self.n_clients)) if self.participants is None else list(self.participants)

    def present_at(self, round_: int) -> list[int]:
        """The training clients present in round ``round_`` (a federation with a schedule), the
        only ones a method that queries every client at once may ask."""
        return self.training_clients if self.present is None else list(self.present(round_))


def check_models_fit(count: int, ctx: Context, key: str) -> None:
    """``count`` models of the run's size must fit the server's model budget (``MAX_MODEL_BYTES``)."""
    need = count * ctx.init_weights.numel() * 4
    if need > MAX_MODEL_BYTES:
        raise UserError(
            f"config: algorithm.{key} = {count}: {count} models of {ctx.init_weights.numel():,} parameters "
            f"need {need / 2**30:.1f} GiB, more than the {MAX_MODEL_BYTES / 2**30:.0f} GiB budget; lower it"
        )


def mean_model(models: list[torch.Tensor]) -> torch.Tensor:
    """The plain mean of several models (one model: itself): the stand-in global model of
    methods that keep several and none global (IFCA, FedEM, FedSoft)."""
    return models[0] if len(models) == 1 else torch.stack(models).mean(0)


def store_shares(store: ClientStore) -> np.ndarray:
    """A store of per-client weights over clusters (N, K) as float64, NaN for clients it has
    no row for (:meth:`Algorithm.assignments`)."""
    rows = np.full((store.n, store.p), np.nan)
    seen = np.flatnonzero(store.has)
    rows[seen] = np.asarray(store.rows[seen], dtype=np.float64)
    return rows


def dominant_labels(store: ClientStore) -> np.ndarray:
    """Each client's cluster as the largest of its weights in ``store`` (-1: no row yet)."""
    labels = np.full(store.n, -1, dtype=np.int64)
    seen = np.flatnonzero(store.has)
    labels[seen] = np.asarray(store.rows[seen]).argmax(1)
    return labels


def train_losses(clients: list[int], models: list[torch.Tensor], ask: AskClients) -> np.ndarray:
    """The loss of every model on every client's TRAIN data, clients x models. One Evaluate
    task per (client, model)."""
    if not clients:
        return np.zeros((0, len(models)))
    res = ask([Evaluate(i, w, "train") for i in clients for w in models])
    return np.array([r.loss for r in res]).reshape(len(clients), len(models))


def lowest_train_loss(clients: list[int], models: list[torch.Tensor], ask: AskClients) -> list[int]:
    """For each client, the index of the model with the lowest loss on its TRAIN data (ties:
    the lower index)."""
    return train_losses(clients, models, ask).argmin(axis=1).tolist()


@dataclass(frozen=True, eq=False)
class Placement:
    """Where a new client lands: its cluster (-1: none), the cosine of its representation to
    that cluster's (StoCFL; None for the others), whether it would open a new cluster, and the
    model it is predicted with."""

    client: int
    cluster: int
    similarity: float | None
    opened_new: bool
    weights: torch.Tensor | Mixture  # a client of FedEM predicts with its mixture of the components


def place_by_lowest_loss(clients: list[int], models: dict[int, torch.Tensor], ask: AskClients) -> list[Placement]:
    """Each client joins the cluster whose model (``models``: cluster id -> weights) has the
    lowest loss on its train data (ties: the lower cluster id)."""
    ids = sorted(models)
    best = lowest_train_loss(clients, [models[k] for k in ids], ask)
    return [Placement(i, ids[b], None, False, models[ids[b]]) for i, b in zip(clients, best)]


class Algorithm:
    """Base class. Subclasses set ``name``, ``Params``, ``State`` and implement ``round``.

    ``State`` is a dataclass holding everything that must outlive a round (see
    :mod:`stocfl.storage.state` for what its fields may hold); ``self.state`` is its value, set in
    ``__init__``, and each of its fields reads and writes as an attribute of the algorithm
    (``self.w`` is ``self.state.w``). Checkpoints and replays of failed rounds go through it
    with no code in the algorithm."""

    name: ClassVar[str]
    Params: ClassVar[type[Params]] = Params
    State: ClassVar[type | None] = None
    state: Any  # the State dataclass's value; a subclass declares its type (state: State)

    def __init__(self, params: Params, ctx: Context):  # type: ignore[valid-type]
        self.params = params
        self.ctx = ctx

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        st = cls.__dict__.get("State")
        if st is None:
            return
        if not dataclasses.is_dataclass(st):
            raise TypeError(f"{cls.__name__}.State must be a dataclass")
        for f in dataclasses.fields(st):
            if f.name in cls.__dict__:
                raise TypeError(f"{cls.__name__}.{f.name} is both a State field and a class attribute")
            setattr(
                cls,
                f.name,
                property(
                    lambda self, n=f.name: getattr(self.state, n), lambda self, v, n=f.name: setattr(self.state, n, v)
                ),
            )

    def encode_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``self.state`` as (tensors, JSON-able meta): a checkpoint's content."""
        if getattr(self, "state", None) is None:
            raise UserError(
                f"algorithm {self.name!r}: set self.state to an instance of its State dataclass in "
                f"__init__ (the state that checkpoints and replays keep)"
            )
        try:
            return state_mod.encode(self.state)
        except state_mod.StateError as err:
            raise UserError(f"algorithm {self.name!r}: {err}") from None

    def decode_state(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Back to the state :meth:`encode_state` gave (tensors, meta); every tensor is copied."""
        self.state = state_mod.decode(tensors, meta, self.state)

    def local_training(
        self,
        round_: int,
        client: int,
        weights: torch.Tensor,
        purpose: int = 0,
        prox_center: torch.Tensor | None = None,
        prox_weight: float = 0.0,
        epochs: int | None = None,
    ) -> Train:
        """A Train task as the run's ``[train]`` says (``ctx.local``: E, B, the optimizer with
        eta; ``epochs``, where a method's paper sets its own count, in place of E) with a seed
        unique to (round, client, purpose)."""
        local = self.ctx.local if epochs is None else dataclasses.replace(self.ctx.local, epochs=epochs)
        return Train(
            client, weights, local, task_seed(self.ctx.seed, round_, client, purpose), prox_center, prox_weight
        )

    def aggregate(self, results: list[Trained], start: torch.Tensor | list[torch.Tensor], weights=None) -> torch.Tensor:
        """The trained models combined by the run's rule (``[aggregation]``; by default the mean
        weighted by ``weights``, else by the samples that trained each); ``start`` is the model
        they were trained from (one, or one per result)."""
        w = [r.n_samples for r in results] if weights is None else weights
        # a factored reply goes as it is: the mean rule sums it from its factors, never formed
        return self.ctx.aggregator([r if isinstance(r, FactoredTrained) else r.weights for r in results], w, start)

    def chain(
        self, clients: list[int], task: Callable[[int, torch.Tensor], Train], start: torch.Tensor, ask: AskClients
    ) -> torch.Tensor:
        """A model trained in a chain, as the StoCFL authors' code trains its global model: each
        client in turn trains from what the client before it returned (``task(client, start)``),
        and the result is the aggregate of the chain's models. Not FedAvg: a round is one
        sequential pass over its clients' data, so its clients cannot train at once."""
        results, starts = [], []
        for i in clients:
            (r,) = ask([task(i, start)])
            results.append(r)
            starts.append(start)
            start = r.weights
        return self.aggregate(results, starts)

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        """One communication round with the sampled clients; returns diagnostics to log."""
        raise NotImplementedError

    def arrive(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """Clients that join a running training at ``round_`` (a federation with a schedule),
        before that round is played: a method that places a client from a one-off query of
        its data does it now (StoCFL); by default nothing happens until the client is sampled.
        Returns diagnostics to log, as :meth:`round` does (docs: living federations, per method)."""
        return {}

    def drifted(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """Clients present in ``round_`` whose data changed concept since the last round (a
        drifting federation whose clients say so, ``scenario.drift_notice``), before the round
        is played: a method that keeps a one-off summary of a client's data redoes it now
        (StoCFL, FL+HC, PACFL); by default nothing happens (methods that choose a client's
        model from its losses every round meet the change when they next ask). Returns
        diagnostics to log, as :meth:`round` does (docs: living federations, per method)."""
        return {}

    def global_model(self) -> torch.Tensor:
        raise NotImplementedError

    def client_models(self, clients: list[int], ask: AskClients) -> list[torch.Tensor] | list[Mixture]:
        """The model each client would use (the same tensor object for clients that share one),
        or its :class:`~stocfl.client.mixture.Mixture` of models (FedEM); ``ask`` is there for
        algorithms that choose by loss (IFCA)."""
        w = self.global_model()
        return [w] * len(clients)

    def cluster_models(self) -> dict[int, torch.Tensor]:
        """Each found cluster's model, by cluster id (none for algorithms without clusters)."""
        return {}

    def cluster_labels(self) -> np.ndarray:
        """Found cluster of every client (-1 = not placed: held out, or not yet seen by an
        algorithm that places clients when it sees them). One model for all: every participant
        is in cluster 0."""
        labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        labels[self.ctx.training_clients] = 0
        return labels

    def assignments(self) -> np.ndarray | None:
        """Each client's weights over the found clusters, (N, K) with rows on the simplex (NaN
        for a client not placed), for algorithms whose clients belong to several (FedEM's
        mixture weights, FedSoft's importance weights); None: each client is wholly in its
        :meth:`cluster_labels` one. Scored against a scenario's true mixtures."""
        return None

    def labelled_models(self, clients: list[int], ask: AskClients) -> list[Any]:
        """For algorithms whose state has ``labels`` (every client's cluster, -1 = not placed) and
        ``models`` (cluster -> model): each client's cluster model, a client not placed by
        :meth:`place_new`."""
        late = {p.client: p.weights for p in self.place_new([i for i in clients if self.state.labels[i] < 0], ask)}
        return [late[i] if i in late else self.state.models[int(self.state.labels[i])] for i in clients]

    placement = "one global model: a new client uses it (cluster 0)"  # what placing a new client means
    places_unlabeled = False  # whether place_unlabeled places a new client without its labels
    placement_unlabeled = ""  # what that means

    def place_unlabeled(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """New clients that hold no labels (test time): which model each would use, from what
        it can compute without labels. Only methods with ``places_unlabeled`` implement it
        (FLUX); the runner then reports a second placement of the held-out clients
        (``heldout_unlabeled`` in summary.json)."""
        raise NotImplementedError(f"{self.name} places new clients from their labels only")

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """Clients that never took part in training: which model each would use.

        The default is the global model, cluster 0 (where :meth:`cluster_labels` puts every
        participant); clustered algorithms override it, and say how in :attr:`placement`."""
        w = self.global_model()
        return [Placement(i, 0, None, False, w) for i in clients]

    def representations(self) -> tuple[list[int], torch.Tensor] | None:
        """Per-client representations kept for plots, as (client ids, rows), if any (the results
        writer draws their cosine matrix and a t-SNE embedding)."""
        return None

    def summary(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The algorithm's own fields of the run's summary, from the metrics rows of every round."""
        return {}

    def plots(self, out: Path, groups: np.ndarray | None, title: str, seed: int) -> None:
        """Draw the algorithm's own figures into the results directory ``out`` (``groups``: every
        client's true group, when known). The results writer has already drawn what every
        algorithm with per-client :meth:`representations` gets (similarity.png, embedding.png);
        by default there is nothing more."""


class OneShotClusters(Algorithm):
    """What methods that cluster their clients and then run FedAvg per cluster share (FL+HC,
    PACFL, FLUX, SR-FCA): ``self.state`` has ``w`` (the model before clustering, the stand-in global model),
    ``labels`` (every client's cluster, -1 = not placed) and ``models`` (cluster id -> model,
    empty until the clustering step). A client not placed when it is sampled or evaluated is
    placed by the subclass's :meth:`place_new`."""

    def train_clusters(self, round_: int, sampled: list[int], ask: AskClients) -> None:
        """One FedAvg round within each cluster over its sampled members (late clients placed first)."""
        late = [i for i in sampled if self.state.labels[i] < 0]
        for p in self.place_new(late, ask):
            self.state.labels[p.client] = p.cluster
        results = ask([self.local_training(round_, i, self.state.models[int(self.state.labels[i])]) for i in sampled])
        for c in self.state.models:
            mine = [r for i, r in zip(sampled, results) if self.state.labels[i] == c]
            if mine:
                self.state.models[c] = self.aggregate(mine, self.state.models[c])

    def arrive(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """After the clustering step an arrival is placed now, as a client not seen then
        (:meth:`place_new`); before it, it is met when first sampled."""
        late = [i for i in clients if self.state.labels[i] < 0] if self.state.models else []
        for p in self.place_new(late, ask):
            self.state.labels[p.client] = p.cluster
        return {"arrivals_placed": len(late)} if late else {}

    def drifted(self, round_: int, clients: list[int], ask: AskClients) -> dict[str, Any]:
        """After the clustering step a client whose data changed is placed anew, as a client
        not seen then (:meth:`place_new`, which no longer counts its old place); before it,
        the clustering step meets its new data."""
        if not self.state.models or not clients:
            return {}
        self.state.labels[clients] = -1
        for p in self.place_new(list(clients), ask):
            self.state.labels[p.client] = p.cluster
        return {"drift_replaced": len(clients)}

    def global_model(self) -> torch.Tensor:
        return self.state.w

    def client_models(self, clients, ask):
        if not self.state.models:
            return [self.state.w] * len(clients)
        return self.labelled_models(clients, ask)

    def cluster_labels(self) -> np.ndarray:
        return self.state.labels.copy() if self.state.models else super().cluster_labels()

    def cluster_models(self) -> dict[int, torch.Tensor]:
        return dict(self.state.models)
