"""What every in-process executor shares: dispatch by task type, evaluation and gradients."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from stocfl.errors import UserError
from stocfl.models import FlatModel
from stocfl.scenarios import Federation
from stocfl.models import linear_model
from stocfl.tasks import (Evaluate, Evaluated, Gradient, Gradiented, Represent, Represented, Result, Task,
                          Train, Trained, batch_plan, count_sketch)

EVAL_CHUNK = 8192  # samples per forward pass when evaluating


class Executor:
    """Runs client tasks on a federation held in this process.

    Subclasses implement :meth:`train`; evaluation and gradients are shared. Evaluation has an
    exact fast path: tasks that share one weights tensor (every client on the global model,
    the members of a cluster) are evaluated in one forward pass over their concatenated data.
    """

    def __init__(self, federation: Federation, model: FlatModel):
        self.fed = federation
        self.model = model
        self._linear: FlatModel | None = None

    def run(self, tasks: list[Task]) -> list[Result]:
        out: list[Result | None] = [None] * len(tasks)
        by_kind: dict[type, list[int]] = defaultdict(list)
        for k, t in enumerate(tasks):
            by_kind[type(t)].append(k)
        handlers = {Train: self.train, Evaluate: self.evaluate, Gradient: self.gradient, Represent: self.represent}
        for kind, idx in by_kind.items():
            for k, r in zip(idx, handlers[kind]([tasks[k] for k in idx])):
                out[k] = r
        return out  # type: ignore[return-value]

    def train(self, tasks: list[Train]) -> list[Trained]:
        raise NotImplementedError

    def loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model.forward(w, x), y)

    @torch.no_grad()
    def evaluate(self, tasks: list[Evaluate]) -> list[Evaluated]:
        out: list[Evaluated | None] = [None] * len(tasks)
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for k, t in enumerate(tasks):
            groups[(id(t.weights), t.split)].append(k)
        for (_, split), idx in groups.items():
            w = tasks[idx[0]].weights
            data = self.fed.train_data if split == "train" else self.fed.test_data
            parts = [data(tasks[k].client) for k in idx]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            losses, correct = [], []
            for a in range(0, len(y), EVAL_CHUNK):
                logits = self.model.forward(w, x[a : a + EVAL_CHUNK])
                losses.append(F.cross_entropy(logits, y[a : a + EVAL_CHUNK], reduction="none").double())
                correct.append(logits.argmax(1) == y[a : a + EVAL_CHUNK])
            loss_all = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
            correct_all = torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool)
            start = 0
            for k, (_, yk) in zip(idx, parts):
                n = len(yk)
                seg = slice(start, start + n)
                out[k] = Evaluated(
                    float(loss_all[seg].mean()) if n else 0.0, int(correct_all[seg].sum()), n
                )
                start += n
        return out  # type: ignore[return-value]

    def gradient(self, tasks: list[Gradient]) -> list[Gradiented]:
        out = []
        for t in tasks:
            x, y = self.fed.train_data(t.client)
            w = t.weights.detach().clone().requires_grad_(True)
            (g,) = torch.autograd.grad(self.loss(w, x, y), w)
            out.append(Gradiented(g.detach(), len(y)))
        return out


    def represent(self, tasks: list[Represent]) -> list[Represented]:
        return [self._represent_one(t) for t in tasks]

    def _represent_one(self, t: Represent) -> Represented:
        model = self.model
        if t.anchor_model == "linear":
            if self._linear is None:
                self._linear = linear_model(self.fed.input_shape, self.fed.n_classes)
            model = self._linear
        if t.anchor.shape != (model.n_params,):
            raise UserError(f"represent task for client {t.client}: anchor has shape {tuple(t.anchor.shape)}, "
                             f"the {t.anchor_model} anchor model has {model.n_params} parameters")
        x, y = self.fed.train_data(t.client)
        grad = linear_softmax_grad if t.anchor_model == "linear" else None
        if t.kind == "gradient":
            if grad is not None:
                g = grad(t.anchor, x.flatten(1), y, self.fed.n_classes)
            else:
                w = t.anchor.detach().clone().requires_grad_(True)
                (g,) = torch.autograd.grad(F.cross_entropy(model.forward(w, x), y), w)
        else:
            w = local_sgd(model, x, y, t.anchor, t.epochs, t.batch_size, t.lr, t.seed, grad=grad)
            g = t.anchor - w
        g = g.detach().double()
        if t.dim:
            g = count_sketch(g, t.dim, t.projection_seed)
        norm = g.norm()
        return Represented((g / norm if norm > 0 else g).float(), len(y))


def linear_softmax_grad(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Exact gradient of the mean cross-entropy of a linear softmax model (weight (C, D) then
    bias (C,), flattened) without autograd: dW = (p - Y)^T x / n, db = mean(p - Y)."""
    d = x.shape[1]
    weight, bias = w[: n_classes * d].view(n_classes, d), w[n_classes * d :]
    err = torch.softmax(x @ weight.T + bias, dim=1)
    err[torch.arange(len(y)), y] -= 1.0
    err /= len(y)
    return torch.cat([(err.T @ x).reshape(-1), err.sum(0)])


def local_sgd(model: FlatModel, x, y, w, epochs, batch_size, lr, seed, center=None, mu: float = 0.0, grad=None):
    """E epochs of mini-batch SGD on f(w) + (mu/2)||w - center||^2, in the order of batch_plan.

    ``grad(w, x_flat, y, n_classes)``, when given, is an exact closed-form gradient used
    instead of autograd (the linear anchor's fast path)."""
    w = w.detach().clone()
    if grad is not None:
        x = x.flatten(1)
        n_classes = len(w) // (x.shape[1] + 1)
    for epoch in batch_plan(len(y), epochs, batch_size, seed):
        for idx in epoch or [None]:
            xb, yb = (x, y) if idx is None else (x[idx], y[idx])
            if grad is not None:
                g = grad(w, xb, yb, n_classes)
            else:
                wl = w.requires_grad_(True)
                (g,) = torch.autograd.grad(F.cross_entropy(model.forward(wl, xb), yb), wl)
                w = wl.detach()
            if center is not None and mu:
                g.add_(w - center, alpha=mu)
            w.add_(g, alpha=-lr)
    return w


def check_train_task(t: Train, n_params: int) -> None:
    if t.weights.shape != (n_params,):
        raise UserError(f"train task for client {t.client}: weights have shape {tuple(t.weights.shape)}, "
                         f"the model has {n_params} parameters")


__all__ = ["Executor", "check_train_task", "linear_softmax_grad", "local_sgd"]
