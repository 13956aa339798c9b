"""FedCCFA (Chen et al., NeurIPS 2024): classifier clustering and feature alignment for
federated learning under distributed concept drift (official code ``wenwenwenwenti/FedCCFA``).

Each round (the paper's Algorithm 1):

1. every sampled client runs the split step (:class:`~stocfl.client.split.SplitTrain`): a
   balanced classifier from the server's initial one, its own classifier, then the feature
   extractor aligned to its feature anchors, and returns the model, the balanced classifier,
   the mean feature of each class (its local anchors) and its label counts;
2. the server averages the feature extractors (weighted by samples; the run's ``[aggregation]``);
3. **class-level classifier clustering**: for each class c, the rows for c of the sampled
   clients' balanced classifiers (weight row and bias) are compared by the MADD distance and
   grouped by DBSCAN (eps, one sample a core point); the clients of a group of two or more
   share the plain mean of their trained classifiers' rows for c, and the mean of their local
   anchors for c (over the members that hold c): the clustered feature anchor;
4. each sampled client keeps its classifier (with the merged rows) and its anchors for the next
   time it is sampled.

A client is evaluated with the current feature extractor and its own classifier.

What stocfl settled where paper and code leave it open (docs/algorithms/fedccfa.md):

* ``[train]`` is the feature extractor's phase (E = the paper's rep_epochs, eta = rep_lr, B, the
  momentum and weight decay, which the classifier phases share); the classifier phases have
  their own epochs and rates (``clf_epochs``, ``clf_lr``, ``balanced_epochs``, ``balanced_lr``).
* The balanced classifier starts from the initial classifier of w_0, which the server never
  trains (the official server sends its model, whose classifier no step updates).
* Alignment starts after ``align_after`` rounds (the code's ``_round >= 20``, 0-based), with
  the anchors the client kept from its last round: the group's anchor for a class it was merged
  on, else its own local anchor, else the round's mean anchor over the clients that hold the
  class (the code has none for a class the client lacks).
* With fewer than 3 clients in a round MADD is undefined: nothing is merged.
* A client never sampled has no classifier of its own: it is evaluated with w_0's classifier
  on the current extractor; a new (held-out) client fine-tunes a classifier of its own on the
  current extractor (the code's ``fine_tune``: ``finetune_epochs`` at ``finetune_lr``).
* FedCCFA has no client-level clusters; ``cluster_labels`` reports the clients of the latest
  round grouped by their merge pattern over all classes (the tuple of the groups they were put
  in), -1 for the others.
* A client whose data drift is met when next sampled (the paper's design: classifiers are
  clustered anew every round); ``Algorithm.drifted`` does nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import ConfigDict, Field

from stocfl.algorithms.base import Algorithm, AskClients, Context, Params, Placement
from stocfl.bounds import MAX_WEIGHT
from stocfl.client.split import Split, SplitTrain, SplitTrained, madd
from stocfl.client.tasks import task_seed
from stocfl.client.training import LocalTraining
from stocfl.storage.store import ClientStore


class FedCCFAParams(Params):
    model_config = ConfigDict(populate_by_name=True)
    clf_epochs: int = Field(1, ge=0, le=1000, description="epochs of the classifier phase (the paper's clf_epochs)")
    clf_lr: float = Field(0.1, gt=0, le=MAX_WEIGHT, description="learning rate of the classifier phase")
    balanced_epochs: int = Field(
        5, ge=0, le=1000, description="epochs of the balanced classifier (0: cluster the trained classifiers)"
    )
    balanced_lr: float = Field(0.1, gt=0, le=MAX_WEIGHT, description="learning rate of the balanced classifier")
    balanced_per_class: int = Field(5, ge=1, le=10**6, description="samples a class in the balanced sample (at most)")
    eps: float = Field(0.1, gt=0, le=2, description="epsilon: DBSCAN's radius on the MADD distances")
    gamma: float = Field(20.0, ge=0, le=MAX_WEIGHT, description="gamma: alignment weight = H(P(y)) / gamma")
    lam: float = Field(
        0.0, ge=0, le=MAX_WEIGHT, alias="lambda", description="lambda: the fixed alignment weight when gamma = 0"
    )
    temperature: float = Field(0.1, gt=0, le=MAX_WEIGHT, description="tau of the contrastive alignment")
    alignment: Literal["contrastive", "l2"] = Field("contrastive", description="how features meet their anchors")
    align_after: int = Field(20, ge=0, le=10**6, description="rounds before the alignment starts")
    finetune_epochs: int = Field(5, ge=0, le=1000, description="a new client's classifier epochs")
    finetune_lr: float = Field(0.01, gt=0, le=MAX_WEIGHT, description="a new client's classifier learning rate")


class FedCCFA(Algorithm):
    """A shared feature extractor; per-client classifiers whose rows are merged class by class
    among clients with the same P(y|x); features aligned to clustered class anchors.

    Parameters
    ----------
    clf_epochs : int, default 1
    clf_lr : float, default 0.1
    balanced_epochs : int, default 5
    balanced_lr : float, default 0.1
    balanced_per_class : int, default 5
    eps : float, default 0.1
    gamma : float, default 20.0
    lambda : float, default 0.0
    temperature : float, default 0.1
    alignment : {"contrastive", "l2"}, default "contrastive"
    align_after : int, default 20
    finetune_epochs : int, default 5
    finetune_lr : float, default 0.01
    """

    name = "fedccfa"
    placement = (
        "a new client fine-tunes a classifier of its own on the current feature extractor (no cluster: -1); "
        "FedCCFA clusters classifiers class by class, not clients"
    )
    Params = FedCCFAParams
    params: FedCCFAParams

    @dataclass
    class State:
        w: torch.Tensor  # the current feature extractor with w_0's classifier
        heads: ClientStore  # each sampled client's classifier
        anchors: ClientStore  # each sampled client's anchors (C * d) and which classes have one (C)
        labels: np.ndarray  # the latest round's clients by merge pattern, -1 for the others

    state: State

    def __init__(self, params: FedCCFAParams, ctx: Context):
        super().__init__(params, ctx)
        self.split = Split.of(ctx.n_trainable or len(ctx.init_weights), ctx.last_layer, ctx.n_classes)
        c, d = self.split.n_classes, self.split.features
        self.state = self.State(
            ctx.init_weights.clone(),
            ctx.store("fedccfa_heads", self.split.size),
            ctx.store("fedccfa_anchors", c * d + c),
            np.full(ctx.n_clients, -1, dtype=np.int64),
        )

    def _phase(self, epochs: int, lr: float) -> LocalTraining:
        """A classifier phase: the run's batch size and optimizer, with its own epochs and rate."""
        local = self.ctx.local
        return dataclasses.replace(local, epochs=epochs, optimizer=dataclasses.replace(local.optimizer, lr=lr))

    def head_of(self, client: int) -> torch.Tensor:
        heads = self.state.heads
        return heads.get(client) if client in heads else self.state.w[self.split.start : self.split.stop]

    def model_of(self, client: int) -> torch.Tensor:
        w = self.state.w.clone()
        w[self.split.start : self.split.stop] = self.head_of(client)
        return w

    def client_step(self, round_: int, client: int) -> SplitTrain:
        c, d = self.split.n_classes, self.split.features
        p = self.params
        kept = self.state.anchors
        if round_ > p.align_after and client in kept:
            row = kept.get(client)
            anchors, mask = row[: c * d], row[c * d :]
        else:
            anchors, mask = torch.zeros(c * d), torch.zeros(c)
        return SplitTrain(
            client,
            self.model_of(client),
            head=self._phase(p.clf_epochs, p.clf_lr),
            body=self.ctx.local,
            balanced=self._phase(p.balanced_epochs, p.balanced_lr),
            balanced_head=self.state.w[self.split.start : self.split.stop].clone(),
            anchors=anchors,
            anchor_mask=mask,
            seed=task_seed(self.ctx.seed, round_, client),
            per_class=p.balanced_per_class,
            gamma=p.gamma,
            lam=p.lam,
            temperature=p.temperature,
            alignment=p.alignment,
        )

    def round(self, round_: int, sampled: list[int], ask: AskClients) -> dict[str, Any]:
        results: list[SplitTrained] = ask([self.client_step(round_, i) for i in sampled])
        split = self.split
        start = split.body(self.state.w)
        body = self.ctx.aggregator([split.body(r.weights) for r in results], [r.n_samples for r in results], start)
        self.state.w = split.join(body, self.state.w[split.start : split.stop])

        groups = self.merge_groups(torch.stack([r.balanced_head for r in results]))
        heads = split.rows(torch.stack([r.weights[split.start : split.stop] for r in results]))  # (n, C, d+1)
        c, d = split.n_classes, split.features
        protos = torch.stack([r.prototypes.reshape(c, d) for r in results])  # (n, C, d)
        holds = torch.stack([r.label_counts > 0 for r in results])  # (n, C)
        anchors, mask = protos.clone(), holds.clone()
        for label, members in groups:
            heads[members, label] = heads[members, label].mean(0)
            have = [i for i in members if holds[i, label]]
            if have:
                anchors[members, label] = protos[have, label].mean(0)
                mask[members, label] = True
        held = holds.any(0)  # the round's mean anchor of a class, for a client with none for it
        mean = (protos * holds.unsqueeze(2)).sum(0) / holds.sum(0).clamp(min=1).unsqueeze(1)
        lacking = ~mask & held.unsqueeze(0)
        anchors[lacking] = mean.unsqueeze(0).expand_as(anchors)[lacking]
        mask |= lacking
        self.state.heads.write({i: split.from_rows(heads[k]) for k, i in enumerate(sampled)})
        self.state.anchors.write({i: torch.cat([anchors[k].flatten(), mask[k].float()]) for k, i in enumerate(sampled)})
        self.state.labels = np.full(self.ctx.n_clients, -1, dtype=np.int64)
        self.state.labels[sampled] = merge_patterns(len(sampled), c, groups)
        return {"merged_classes": len({label for label, _ in groups}), "patterns": int(self.state.labels.max() + 1)}

    def merge_groups(self, balanced: torch.Tensor) -> list[tuple[int, list[int]]]:
        """(class, members) for every group of two or more of the round's clients (indices into
        it) whose balanced classifier rows for that class DBSCAN puts together on MADD."""
        from sklearn.cluster import DBSCAN  # here: scikit-learn's import costs a second at every start

        if len(balanced) < 3:
            return []
        rows = self.split.rows(balanced)
        out = []
        for label in range(self.split.n_classes):
            dist = madd(rows[:, label]).numpy()
            found = DBSCAN(eps=self.params.eps, min_samples=1, metric="precomputed").fit(dist).labels_
            for g in np.unique(found):
                members = np.flatnonzero(found == g).tolist()
                if len(members) > 1:
                    out.append((label, members))
        return out

    def global_model(self) -> torch.Tensor:
        return self.state.w

    def client_models(self, clients, ask):
        return [self.model_of(i) for i in clients]

    def cluster_labels(self) -> np.ndarray:
        return self.state.labels.copy()

    def place_new(self, clients: list[int], ask: AskClients) -> list[Placement]:
        """A new client trains a classifier of its own from w_0's on the current extractor."""
        if not clients:
            return []
        c, d = self.split.n_classes, self.split.features
        off = dataclasses.replace(self.ctx.local, epochs=0)  # no body phase, no balanced classifier
        tasks = [
            SplitTrain(
                i,
                self.state.w.clone(),
                head=self._phase(self.params.finetune_epochs, self.params.finetune_lr),
                body=off,
                balanced=off,
                balanced_head=self.state.w[self.split.start : self.split.stop].clone(),
                anchors=torch.zeros(c * d),
                anchor_mask=torch.zeros(c),
                seed=task_seed(self.ctx.seed, 0, i, 7),
            )
            for i in clients
        ]
        return [Placement(i, -1, None, False, r.weights) for i, r in zip(clients, ask(tasks))]


def merge_patterns(n: int, n_classes: int, groups: list[tuple[int, list[int]]]) -> np.ndarray:
    """Each of n clients' merge pattern (for every class, the group it is in, or alone) as ids
    0.. in order of first appearance: clients merged alike on every class share an id."""
    pattern = [[-1] * n_classes for _ in range(n)]
    for g, (label, members) in enumerate(groups):
        for i in members:
            pattern[i][label] = g
    ids: dict[tuple[int, ...], int] = {}
    out = np.zeros(n, dtype=np.int64)
    for i, p in enumerate(pattern):
        key = tuple(p) if any(x >= 0 for x in p) else (-1 - i,)  # merged on nothing: alone
        out[i] = ids.setdefault(key, len(ids))
    return out
