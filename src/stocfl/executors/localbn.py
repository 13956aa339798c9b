"""FedBN (Li et al., ICLR 2021): BatchNorm kept per client, ``train.local_bn = true``.

Every BatchNorm layer's entries (weight and bias, running mean and variance, batch count)
belong to the client. Each task a client runs (training, evaluation) starts from the weights
it is sent with these entries replaced by the client's own, once it has trained; before that
it uses what it is sent. After a task list the client keeps the entries its own model came
back with: those of its Train task with a proximal center (the personal or cluster model of
Ditto, StoCFL, FedProx and FeSEM, whose other task trains the global model), else of its first
Train task. Algorithms still aggregate whatever comes back, so a global model carries averaged
BatchNorm entries; clients that never trained (new clients) use those.

This sits between the algorithm and the engine, as the clients' side would: no algorithm
knows of it. The entries live in a :class:`~stocfl.storage.store.ClientStore` (in the run directory,
or in memory) that is part of the checkpoint, so replayed rounds and resumed runs see what
they saw. Held by the server in this simulation, they travel with the client's own tasks only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from stocfl.client.tasks import Evaluate, Train
from stocfl.storage.store import RAM, ClientStore


class LocalBatchNorm:
    def __init__(self, entries: torch.Tensor, n_clients: int, workdir: Path | None = None, ram: int = RAM):
        self.idx = entries
        self.store = ClientStore(n_clients, len(entries), workdir, "local_bn", ram)

    def own(self, client: int, w: torch.Tensor | None) -> torch.Tensor | None:
        """``w`` with the client's BatchNorm entries, once it has any."""
        if w is None or client not in self.store:
            return w
        w = w.clone()
        w[self.idx] = self.store.get(client)
        return w

    def personalise(self, task):
        if isinstance(task, Train):
            return dataclasses.replace(
                task, weights=self.own(task.client, task.weights), prox_center=self.own(task.client, task.prox_center)
            )
        if isinstance(task, Evaluate):
            return dataclasses.replace(task, weights=self.own(task.client, task.weights))
        return task

    def wrap(self, run):
        """``run`` (a task runner) as the clients with local BatchNorm would answer."""

        def run_local(tasks):
            results = run([self.personalise(t) for t in tasks])
            kept: dict[int, tuple[bool, torch.Tensor]] = {}  # client -> (from a proximal task, entries)
            for t, r in zip(tasks, results):
                if isinstance(t, Train):
                    prox = t.prox_center is not None
                    if t.client not in kept or (prox and not kept[t.client][0]):
                        kept[t.client] = (prox, r.weights[self.idx].clone())
            if kept:
                self.store.write({c: e for c, (_, e) in kept.items()})
            return results

        return run_local

    def state(self):
        return self.store.state()

    def load_state(self, tensors, meta):
        self.store.load_state(tensors, meta)
