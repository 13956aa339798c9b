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

The count depends on the task's shape, not its numbers: the kind (and its reference function),
its fields other than the client and its seeds (a tensor by its shape, anything else by value),
the client's train and test sizes and, for the kinds that declare it (``TaskKind.cost_by_labels``:
a per-label SVD, a class-balanced sample), its train labels' counts; and the model (its modules
as they print, its tensors' shapes and types, its loss) and the samples' shape. A process counts
each such shape once and reuses the count, across runs too (a benchmark runs thousands of runs of
a few models in one process, each of which counted afresh for about a second). Caches that stand
for work every client does (:data:`CLIENT_CACHES`) are cleared before a count, so a count does
not depend on what the process ran before.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, flop_registry

from stocfl.client.tasks import ClientData, field_names, kind_of

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


aten = torch.ops.aten


# the thin SVD, and the in-place products torch's registry leaves out (the low-rank path forms
# its first layer with baddbmm_)
def _as_registered(packet):
    """Torch's formula for ``packet``, as registered (it takes tensors, not their shapes)."""
    formula = flop_registry[packet]

    def count(*args, **kwargs):
        return formula(*args, **kwargs)

    count._get_raw = True
    return count


MAPPING = {
    aten._linalg_svd: svd_flops,
    aten.baddbmm_: _as_registered(aten.baddbmm),
    aten.addmm_: _as_registered(aten.addmm),
}


class _Counter(FlopCounterMode):
    """``FlopCounterMode`` without its per-module breakdown: the module tracker's backward hooks
    refuse ``torch.autograd.grad`` (and ``torch.func.grad``) on a module's leaf input, which
    the low-rank path and a tail's gradient take; only the total is needed here."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        mode, self.mode = self.mode, None
        return mode.__exit__(*args) if mode is not None else None


def count_flops(fn, *args) -> int:
    """FLOPs of ``fn(*args)`` as counted here (matrix products, convolutions, thin SVDs)."""
    for cache in CLIENT_CACHES:
        cache.cache_clear()
    counter = _Counter(display=False, custom_mapping=MAPPING)
    with counter:
        fn(*args)
    return int(counter.get_total_flops())


def _shape_key(task) -> tuple:
    key: list[Any] = [type(task)]
    for name in field_names(task):
        if name == "client" or name.endswith("seed"):
            continue
        v = getattr(task, name)
        key.append((name, ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v))
    return tuple(key)


# (model, samples) -> (counts by (task shape, n_train, n_test), affine coefficients by task
# shape): the counts every FlopCount of this process shares
_SHARED: dict[tuple, tuple[dict[tuple, int], dict[tuple, tuple[int, int, int] | None]]] = {}


def _context(fed, model) -> tuple:
    """What a count depends on besides the task and the client's sizes: the model's modules as
    they print (layer sizes, strides, kernels), its tensors' shapes and types, its loss, and the
    samples' shape, type and classes."""
    return (
        type(model.module),
        str(model.module),
        tuple(model.shapes),
        tuple(model.dtypes),
        model.loss,
        tuple(fed.x_train.shape[1:]),
        fed.x_train.dtype,
        fed.n_classes,
    )


class FlopCount:
    """Counts the FLOPs of tasks on ``fed``'s clients with ``model`` (see the module docstring);
    ``seconds`` is the time spent counting, which a round's time leaves out.

    Counting runs a task's computation under a dispatch mode, some twenty times slower than the
    computation itself, so a federation whose clients all differ in size (a Dirichlet split)
    would pay for one slow count per client. A task shape's count is therefore found as a
    function of the client's train and test sizes: the counts on the client's first 1, 2 and 3
    samples give a + b n_train + c n_test, which must then give the count on (3, 3) samples and
    on the whole client exactly; it is used for every other client of that shape. A kind whose
    count is not of that form (or that refuses so few samples) is counted client by client."""

    def __init__(self, fed, model) -> None:
        self.fed, self.model = fed, model
        self.known, self.affine = _SHARED.setdefault(_context(fed, model), ({}, {}))
        self.seconds = 0.0
        # each client's train and test sizes as plain ints (indexing the offsets' tensors costs
        # microseconds a task, and a round asks for every task's)
        self.sizes = list(zip(fed.train_sizes.tolist(), fed.test_sizes.tolist()))

    def client(self, i: int, n_train: int | None = None, n_test: int | None = None) -> ClientData:
        """Client ``i``'s data (its first ``n_train`` and ``n_test`` samples where given), with
        the model's probes of its input shape already made (the evaluation chunk, the memory
        layout: the engine's one-off forward passes, not a client's)."""
        x, y = self.fed.train_data(i)
        xt, yt = self.fed.test_data(i)
        x, y, xt, yt = x[:n_train], y[:n_train], xt[:n_test], yt[:n_test]
        for inputs in (x, xt):
            self.model.eval_chunk(inputs)
            self.model.layout(inputs[:1])
        return ClientData(i, x, y, xt, yt, self.model, self.fed.n_classes)

    def __call__(self, task) -> int:
        kind = kind_of(type(task))
        i = task.client
        n_train, n_test = self.sizes[i]
        shape = (kind.reference, *_shape_key(task))
        if kind.cost_by_labels:
            a, b = int(self.fed.train_offsets[i]), int(self.fed.train_offsets[i + 1])
            shape += (tuple(torch.bincount(self.fed.y_train[a:b], minlength=self.fed.n_classes).tolist()),)
        key = (shape, n_train, n_test)
        if key not in self.known:
            t = time.perf_counter()
            if kind.cost_by_labels:
                self.known[key] = count_flops(kind.reference, self.client(i), task)
            else:
                if shape not in self.affine:  # counts this client whole on the way
                    self.affine[shape] = self._fit(kind, task, key)
                coef = self.affine[shape]
                if key not in self.known:
                    self.known[key] = (
                        count_flops(kind.reference, self.client(i), task)
                        if coef is None
                        else coef[0] + coef[1] * n_train + coef[2] * n_test
                    )
            self.seconds += time.perf_counter() - t
        return self.known[key]

    def _fit(self, kind, task, key: tuple) -> tuple[int, int, int] | None:
        """(a, b, c) with count = a + b n_train + c n_test for this task's shape, checked on
        (3, 3) samples and on the whole client (whose count it records under ``key``, its
        (shape, n_train, n_test)); None where the count is not of that form."""
        _, n_train, n_test = key
        whole = self.known[key] = count_flops(kind.reference, self.client(task.client), task)
        if n_train < 3 or n_test < 3:
            return None
        try:
            at = {(p, q): count_flops(kind.reference, self.client(task.client, p, q), task) for p, q in _POINTS}
        except Exception:  # noqa: BLE001 - a kind may refuse a client of so few samples
            return None
        a11 = at[1, 1]
        b, c = at[2, 1] - a11, at[1, 2] - a11
        a = a11 - b - c
        if at[3, 3] != a + 3 * b + 3 * c or whole != a + b * n_train + c * n_test:
            return None
        return a, b, c


_POINTS = ((1, 1), (2, 1), (1, 2), (3, 3))
