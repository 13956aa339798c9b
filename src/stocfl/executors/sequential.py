"""The reference executor: every task kind's reference function, client by client.

No DataLoader, no module copies: a client's data is a view into the federation's stacked
tensors, its model a flat vector, one autograd call per step (``stocfl.client.training.local_sgd``)."""

from __future__ import annotations

from stocfl.executors.base import Executor


class SequentialExecutor(Executor):
    name = "sequential"
