"""The reference executor: a tight loop over clients and mini-batches.

No DataLoader, no module copies: a client's data is a view into the federation's stacked
tensors, its model a flat vector, one autograd call per step."""

from __future__ import annotations

from stocfl.executors.base import Executor, check_train_task, local_sgd
from stocfl.tasks import Train, Trained


class SequentialExecutor(Executor):
    def train(self, tasks: list[Train]) -> list[Trained]:
        return [self._train_one(t) for t in tasks]

    def _train_one(self, t: Train) -> Trained:
        check_train_task(t, self.model.n_params)
        x, y = self.fed.train_data(t.client)
        w = local_sgd(self.model, x, y, t.weights, t.epochs, t.batch_size, t.lr, t.seed, t.prox_center, t.prox_weight)
        return Trained(w, len(y))
