"""Client-side FLOPs of a task, counted: the task kind's reference function run once under
torch's ``FlopCounterMode`` on the real client's data, for every task of the same shape.

What a method asks of its clients is the computation of its tasks' reference functions, whatever
the engine that runs them (the batched and low-rank paths do other arithmetic for the same
numbers; a Flower client runs the reference). So a task's FLOPs are those of its reference on
that client, counted by torch, not estimated from a formula: a kind registered by a user is
counted as a built-in is. ``FlopCounterMode`` counts the matrix products and convolutions (the
arithmetic that dominates training and evaluation, forward and backward, two FLOPs a
multiply-add); to it we add the thin SVD (:func:`svd_flops`), which PACFL's subspace query and
FLUX's projection axes do on the client and torch does not count. Element-wise work (activations,
optimizer steps, losses) is left out, as torch leaves it out.

The count depends on the task's shape, not its numbers: the kind, its fields other than the
client and its seeds (a tensor by its shape, anything else by value), the client's train and
test sizes and, for the kinds that declare it (``TaskKind.cost_by_labels``: a per-label SVD, a
class-balanced sample), its train labels' counts. A run counts each shape once and reuses the
count. Caches that stand for work every client does (:data:`CLIENT_CACHES`) are cleared before a
count, so a count does not depend on what the process ran before.
"""

from __future__ import annotations

import time
from dataclasses import fields
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from stocfl.client.tasks import ClientData, kind_of

CLIENT_CACHES: list[Any] = []  # functools caches of client-side work, cleared before a count


def svd_flops(a_shape, *args, out_shape=None, **kwargs) -> int:
    """The thin SVD of an m x n matrix (U, S and V), m >= n: 6 m n^2 + 20 n^3 (Golub and Van
    Loan, Matrix Computations, R-SVD), times the batch."""
    *batch, m, n = a_shape
    m, n = max(m, n), min(m, n)
    count = 1
    for b in batch:
        count *= b
    return int(count * (6 * m * n * n + 20 * n**3))


MAPPING = {torch.ops.aten._linalg_svd: svd_flops}


def count_flops(fn, *args) -> int:
    """FLOPs of ``fn(*args)`` as counted here (matrix products, convolutions, thin SVDs)."""
    for cache in CLIENT_CACHES:
        cache.cache_clear()
    counter = FlopCounterMode(display=False, custom_mapping=MAPPING)
    with counter:
        fn(*args)
    return int(counter.get_total_flops())


def _shape_key(task) -> tuple:
    key: list[Any] = [type(task)]
    for f in fields(task):
        if f.name == "client" or f.name.endswith("seed"):
            continue
        v = getattr(task, f.name)
        key.append((f.name, ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v))
    return tuple(key)


class FlopCount:
    """Counts the FLOPs of tasks on ``fed``'s clients with ``model`` (see the module docstring);
    ``seconds`` is the time spent counting, which a round's time leaves out."""

    def __init__(self, fed, model) -> None:
        self.fed, self.model = fed, model
        self.known: dict[tuple, int] = {}
        self.seconds = 0.0

    def client(self, i: int) -> ClientData:
        """Client ``i``'s data, with the model's probes of its input shape already made (the
        evaluation chunk, the memory layout: the engine's one-off forward passes, not a client's)."""
        x, y = self.fed.train_data(i)
        xt, yt = self.fed.test_data(i)
        for inputs in (x, xt):
            self.model.eval_chunk(inputs)
            self.model.layout(inputs[:1])
        return ClientData(i, x, y, xt, yt, self.model, self.fed.n_classes)

    def __call__(self, task) -> int:
        kind = kind_of(type(task))
        a, b = self.fed.train_offsets[task.client], self.fed.train_offsets[task.client + 1]
        c, d = self.fed.test_offsets[task.client], self.fed.test_offsets[task.client + 1]
        key: tuple = (_shape_key(task), int(b - a), int(d - c))
        if kind.cost_by_labels:
            key += (tuple(torch.bincount(self.fed.y_train[a:b], minlength=self.fed.n_classes).tolist()),)
        if key not in self.known:
            t = time.perf_counter()
            self.known[key] = count_flops(kind.reference, self.client(task.client), task)
            self.seconds += time.perf_counter() - t
        return self.known[key]
