"""The reference executor: a tight loop over clients and mini-batches.

No DataLoader, no module copies: a client's data is a view into the federation's stacked
tensors, its model a flat vector, one autograd call per step."""

from __future__ import annotations

import torch

from stocfl.executors.base import Executor, check_train_task
from stocfl.tasks import Train, Trained, batch_plan


class SequentialExecutor(Executor):
    def train(self, tasks: list[Train]) -> list[Trained]:
        return [self._train_one(t) for t in tasks]

    def _train_one(self, t: Train) -> Trained:
        check_train_task(t, self.model.n_params)
        x, y = self.fed.train_data(t.client)
        w = t.weights.detach().clone()
        center = t.prox_center
        for epoch in batch_plan(len(y), t.epochs, t.batch_size, t.seed):
            for idx in epoch or [None]:
                xb, yb = (x, y) if idx is None else (x[idx], y[idx])
                wl = w.requires_grad_(True)
                (g,) = torch.autograd.grad(self.loss(wl, xb, yb), wl)
                w = wl.detach()
                if center is not None and t.prox_weight:
                    g.add_(w - center, alpha=t.prox_weight)
                w.add_(g, alpha=-t.lr)
        return Trained(w, len(y))
