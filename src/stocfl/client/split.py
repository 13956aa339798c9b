"""Split training of a body and a head: FedCCFA's client step (Chen et al., NeurIPS 2024,
"Classifier Clustering and Feature Alignment for Federated Learning under Distributed Concept
Drift"; official code ``wenwenwenwenti/FedCCFA``, ``entities/FedCCFA.py``).

The model is a feature extractor (the body: every parameter and buffer but the last layer's)
and a classifier (the head: the last ``nn.Linear`` layer, weight and bias, the last of the
parameters). A client, given the global body and its own head, does in order:

1. **Balanced classifier** (``balanced``, skipped when its epochs are 0): a head trained from
   ``balanced_head`` (the server's initial classifier) on a class-balanced sample of the client's
   data (of each label it holds, min(the smallest label count, ``per_class``) samples drawn
   without replacement), the body frozen. The server clusters these heads: trained from one
   start on balanced data, their rows differ where the clients' P(y|x) differ, not where their
   P(y) does.
2. **Classifier** (``head``): the head trained on all the client's data, the body frozen.
3. **Feature extractor** (``body``): the body trained on the client's data, the head frozen,
   on loss = CE + a * alignment. With ``anchors`` (one feature anchor a class, those the
   client is given) the alignment is contrastive (the paper's choice: cross-entropy of the
   cosines of a sample's feature to every anchor over ``temperature``, its own class the
   target) or ``l2`` (mean squared distance to its class's anchor); a class without an anchor
   is left out of the contrast, and a sample of such a class out of the alignment. The weight
   a = H(P(y)) / ``gamma`` (the entropy of the client's label distribution, natural log) when
   ``gamma`` > 0, else ``lam``: the more classes a client holds evenly, the more its features
   are pulled toward the anchors.
4. **Prototypes**: the mean feature of each class the client holds, at the trained weights
   (eval mode), and its label counts.

A feature is the input of the model's last ``nn.Linear`` layer. Each phase draws its
mini-batches from its own seed (``seed`` with the phase's number), each optimizer starts fresh.

What the reply reveals beyond a trained model: the client's label counts and the mean
feature of each class it holds (the paper's "local anchors").

A registered task kind (``train.split``): every executor runs it and the Flower codec carries it
from its fields.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stocfl.client.models import FlatModel
from stocfl.client.tasks import (
    MAX_ABS,
    BadResult,
    ClientData,
    _count,
    check_vector,
    check_weights,
    largest_change,
    largest_sent,
    register_task,
)
from stocfl.client.training import LocalTraining, _seeded, batch_plan, rows_of
from stocfl.errors import UserError


@dataclass(frozen=True, eq=False)
class SplitTrain:
    """FedCCFA's client step from ``weights`` (the global body with the client's head): a
    balanced head from ``balanced_head`` (``balanced``), the head (``head``), then the body
    (``body``) aligned to ``anchors`` ((C * d,) one anchor a class, d the feature size;
    ``anchor_mask`` (C,) 1 where a class has one; an empty ``anchor_mask`` or ``align_weight``
    ... 0 turns the alignment off)."""

    client: int
    weights: torch.Tensor
    head: LocalTraining
    body: LocalTraining
    balanced: LocalTraining
    balanced_head: torch.Tensor
    anchors: torch.Tensor
    anchor_mask: torch.Tensor
    seed: int
    per_class: int = 5
    gamma: float = 20.0
    lam: float = 0.0
    temperature: float = 0.1
    alignment: Literal["contrastive", "l2"] = "contrastive"


@dataclass(frozen=True, eq=False)
class SplitTrained:
    weights: torch.Tensor  # the model after the head and body phases
    balanced_head: torch.Tensor  # (L,) the balanced classifier (the trained head when that phase is off)
    prototypes: torch.Tensor  # (C * d,) the mean feature of each class, 0 for a class the client lacks
    label_counts: torch.Tensor  # (C,) samples of each label
    n_samples: int


@dataclass(frozen=True)
class Split:
    """Where a model's head lies in its flat vector: ``start:stop`` (weight rows, then bias),
    ``n_classes`` C rows of ``features`` d inputs each; the rest is the body."""

    start: int
    stop: int
    n_classes: int
    features: int

    @classmethod
    def of(cls, n_trainable: int, last_layer: int, n_classes: int) -> Split:
        if n_classes < 1 or last_layer % n_classes or last_layer // n_classes < 2:
            raise UserError(
                f"fedccfa: the output layer has {last_layer} entries, not a weight and a bias of {n_classes} rows; "
                f"the model's last layer must be nn.Linear(d, classes) with a bias"
            )
        return cls(n_trainable - last_layer, n_trainable, n_classes, last_layer // n_classes - 1)

    @property
    def size(self) -> int:
        return self.stop - self.start

    def rows(self, head: torch.Tensor) -> torch.Tensor:
        """A head (L,) or heads (n, L) as one row a class: (..., C, d + 1), weight row then bias."""
        c, d = self.n_classes, self.features
        w = head[..., : c * d].reshape(*head.shape[:-1], c, d)
        return torch.cat([w, head[..., c * d :].unsqueeze(-1)], -1)

    def from_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`rows`."""
        return torch.cat([rows[..., :-1].flatten(-2), rows[..., -1]], -1)

    def body(self, w: torch.Tensor) -> torch.Tensor:
        """The body's entries of ``w`` (a copy): parameters before the head, buffers after it."""
        return torch.cat([w[: self.start], w[self.stop :]])

    def join(self, body: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """A model from a body (as :meth:`body` gives it) and a head."""
        return torch.cat([body[: self.start], head, body[self.start :]])


def classifier(model: FlatModel) -> nn.Linear:
    """The model's last ``nn.Linear`` layer, which must be its last parameters (weight, bias)."""
    last = [(n, m) for n, m in model.module.named_modules() if isinstance(m, nn.Linear)]
    k = model.n_tensors
    if (
        not last
        or last[-1][1].bias is None
        or model.names[k - 2 : k] != [f"{last[-1][0]}.weight", f"{last[-1][0]}.bias"]
    ):
        raise UserError(
            "fedccfa: the model's classifier must be its last nn.Linear layer, with a bias, and the last of its "
            "parameters (the body is everything before it)"
        )
    return last[-1][1]


@contextlib.contextmanager
def features_of(model: FlatModel):
    """While open, every forward of ``model`` appends the input of its classifier (flattened) to
    the yielded list: the sample's feature, in the autograd graph of that forward."""
    seen: list[torch.Tensor] = []
    handle = classifier(model).register_forward_pre_hook(lambda _m, args: seen.append(args[0].flatten(1)))
    try:
        yield seen
    finally:
        handle.remove()


def entropy(counts: torch.Tensor) -> float:
    """H(P(y)) in nats of a label count vector (0 log 0 = 0)."""
    p = counts.double() / counts.sum()
    p = p[p > 0]
    return float(-(p * p.log()).sum())


def alignment_loss(
    feats: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, mask: torch.Tensor, how: str, temperature: float
) -> torch.Tensor:
    """The alignment of a batch's features (B, d) to the class anchors (C, d) present in
    ``mask`` (C,): contrastive (cross-entropy of cosines / temperature) or l2 (mean squared
    error to the own class's anchor, over the entries), over the samples whose class has one."""
    keep = mask[y]
    if not bool(keep.any()):
        return feats.sum() * 0.0
    f, yk = feats[keep], y[keep]
    if how == "l2":
        return F.mse_loss(f, anchors[yk])
    cos = F.cosine_similarity(f.unsqueeze(1), anchors.unsqueeze(0), dim=2, eps=1e-8)
    logits = (cos / temperature).masked_fill(~mask.unsqueeze(0), float("-inf"))
    return F.cross_entropy(logits, yk)


def _phase(
    model: FlatModel,
    w: torch.Tensor,
    part: slice,
    x: torch.Tensor,
    y: torch.Tensor,
    local: LocalTraining,
    seed: int,
    extra=None,
) -> None:
    """``local.epochs`` epochs of ``local.optimizer`` on the parameters ``w[part]`` (in place),
    the others fixed; loss = mean CE + ``extra(features, y)`` when given."""
    if local.epochs == 0 or len(y) == 0:
        return
    p = model.n_trainable
    params = w[:p]  # a view: steps write into w
    trained = params[part]
    opt = local.optimizer
    state = opt.init(trained)
    k = model.n_tensors
    starts = [0, *np.cumsum(model.numels[:k]).tolist()]
    mine = [starts[j] >= part.start and starts[j + 1] <= part.stop for j in range(k)]
    views = model.param_views(params)
    x_rows, y_rows = rows_of(x), rows_of(y)
    with _seeded(seed, x.device) if model.random else contextlib.nullcontext(), features_of(model) as seen:
        for epoch in batch_plan(len(y), local.epochs, local.batch_size, seed):
            for idx in list(epoch) if epoch else [None]:
                xb, yb = (x, y) if idx is None else (x_rows(idx), y_rows(idx))
                leaves = [v.detach().requires_grad_(True) if m else v.detach() for v, m in zip(views, mine)]
                buffers = model.split_buffers(w) if model.has_buffers else []
                seen.clear()
                logits = model.forward_tensors(leaves, buffers, xb)
                loss = model.mean_loss(logits, yb)
                if extra is not None:
                    loss = loss + extra(seen[-1], yb)
                gs = torch.autograd.grad(loss, [v for v, m in zip(leaves, mine) if m])
                if buffers:
                    w[p:] = torch.cat([t.reshape(-1) for t in buffers])
                g = torch.cat([t.reshape(-1) for t in gs])
                if opt.plain:
                    trained.sub_(g, alpha=opt.lr)
                else:
                    opt.step(trained, g, state)


def balanced_sample(y: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """Indices of a class-balanced sample: of each label present, min(its smallest count,
    ``per_class``) drawn without replacement, in a seeded shuffled order."""
    labels, counts = torch.unique(y, return_counts=True)
    take = min(int(counts.min()), per_class) if len(labels) else 0
    g = torch.Generator().manual_seed(int(seed))
    picks = [
        torch.nonzero(y == c).flatten()[torch.randperm(int(n), generator=g)[:take]] for c, n in zip(labels, counts)
    ]
    idx = torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long)
    return idx[torch.randperm(len(idx), generator=g)]


def check_split_task(t: SplitTrain, model: FlatModel, split: Split) -> None:
    check_weights("split train", t, model.n_params)
    for what, v, n in (
        ("balanced_head", t.balanced_head, split.size),
        ("anchors", t.anchors, split.n_classes * split.features),
        ("anchor_mask", t.anchor_mask, split.n_classes),
    ):
        if v.shape != (n,):
            raise UserError(
                f"split train task for client {t.client}: {what} has shape {tuple(v.shape)}, expected ({n},)"
            )


def split_of(c: ClientData) -> Split:
    model = c.model
    classifier(model)
    k = model.n_tensors
    return Split.of(model.n_trainable, model.numels[k - 2] + model.numels[k - 1], c.n_classes)


def split_train(c: ClientData, t: SplitTrain) -> SplitTrained:
    """The reference: the three phases and the prototypes on the client's train data."""
    model, split = c.model, split_of(c)
    check_split_task(t, model, split)
    x, y = model.layout(c.x), c.y
    head = slice(split.start, split.stop)
    body = slice(0, split.start)

    w = t.weights.detach().clone()
    if t.balanced.epochs:
        wb = w.clone()
        wb[head] = t.balanced_head
        idx = balanced_sample(y, t.per_class, t.seed)
        _phase(model, wb, head, x[idx], y[idx], t.balanced, task_phase(t.seed, 0))
        balanced = wb[head].clone()
    _phase(model, w, head, x, y, t.head, task_phase(t.seed, 1))
    counts = torch.bincount(y, minlength=split.n_classes)[: split.n_classes]
    mask = t.anchor_mask > 0.5
    weight = entropy(counts) / t.gamma if t.gamma > 0 else t.lam
    extra = None
    if weight and bool(mask.any()):
        anchors = t.anchors.reshape(split.n_classes, split.features)

        def extra(feats, yb):
            return weight * alignment_loss(feats, yb, anchors, mask, t.alignment, t.temperature)

    _phase(model, w, body, x, y, t.body, task_phase(t.seed, 2), extra)
    if not t.balanced.epochs:
        balanced = w[head].clone()
    return SplitTrained(w, balanced, prototypes(model, w, x, y, split).flatten(), counts.float(), len(y))


def task_phase(seed: int, phase: int) -> int:
    """The seed of one phase of a task (independent streams for its mini-batch orders)."""
    return int(np.random.SeedSequence([int(seed), phase]).generate_state(1)[0])


@torch.no_grad()
def prototypes(model: FlatModel, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, split: Split) -> torch.Tensor:
    """(C, d): the mean feature of each class at ``w`` (eval mode), zeros for a class absent."""
    sums = torch.zeros(split.n_classes, split.features, dtype=torch.float64)
    chunk = model.eval_chunk(x) if len(y) else 1
    with features_of(model) as seen:
        for a in range(0, len(y), chunk):
            seen.clear()
            model.forward(w, x[a : a + chunk])
            sums.index_add_(0, y[a : a + chunk], seen[-1].double())
    counts = torch.bincount(y, minlength=split.n_classes)[: split.n_classes].double().clamp(min=1)
    return (sums / counts[:, None]).float()


def check_split_trained(t: SplitTrain, r: SplitTrained, train_size: int, test_size: int) -> SplitTrained:
    """A reply is a model and a head of the task's sizes, prototypes of C * d entries (all 0 for a
    class the client lacks), label counts that are whole numbers >= 0 summing to the client's
    train size, finite, the counts and prototypes within MAX_ABS (the model and the head are
    bounded by how far they moved, :func:`~stocfl.client.tasks.out_of_bound`); anything else is
    refused."""
    _count(r.n_samples, train_size, "n_samples")
    check_vector(r.weights, "weights", t.weights.numel())  # their size is bounded by out_of_bound
    check_vector(r.balanced_head, "balanced_head", t.balanced_head.numel())
    c = t.anchor_mask.numel()
    counts = check_vector(r.label_counts, "label_counts", c, MAX_ABS)
    if (counts < 0).any() or (counts != counts.round()).any() or int(counts.sum()) != train_size:
        raise BadResult(f"label_counts are not {c} whole numbers >= 0 summing to the client's {train_size} samples")
    protos = check_vector(r.prototypes, "prototypes", t.anchors.numel(), MAX_ABS).reshape(c, -1)
    if bool((protos[counts == 0] != 0).any()):
        raise BadResult("prototypes given for a class the client holds no sample of")
    return r


MADD_BLOCK = 2**24  # entries of the (rows, n, n) differences held at once


def madd(vectors: torch.Tensor) -> torch.Tensor:
    """The MADD distance between n vectors (rows, n >= 3; FedCCFA's choice, after Sarkar et
    al.): d(i, j) = mean over the other n - 2 vectors z of |cos(v_i, v_z) - cos(v_j, v_z)|, in
    float64. A zero vector's cosines are 0."""
    v = vectors.double()
    n = len(v)
    if n < 3:
        raise ValueError("madd needs at least 3 vectors")
    norm = v.norm(dim=1, keepdim=True)
    unit = v / torch.where(norm > 0, norm, 1.0)
    s = unit @ unit.T
    total = torch.empty_like(s)  # sum over every z of |s_iz - s_jz|, in blocks of rows i
    block = max(1, MADD_BLOCK // (n * n))
    for a in range(0, n, block):
        total[a : a + block] = (s[a : a + block].unsqueeze(1) - s.unsqueeze(0)).abs().sum(2)
    own = (s.diagonal().unsqueeze(1) - s).abs()  # |s_ii - s_ji|: the term z = i
    d = (total - own - own.T) / (n - 2)
    return d.fill_diagonal_(0.0)


register_task(
    SplitTrain,
    SplitTrained,
    split_train,
    "train.split",
    check_split_trained,
    reply_size=lambda t: t.weights.numel() + t.balanced_head.numel() + t.anchors.numel() + t.anchor_mask.numel(),
    moved=lambda t, r: (
        max(largest_change(r.weights, t.weights), largest_change(r.balanced_head, t.balanced_head)),
        max(largest_sent(t.weights), largest_sent(t.balanced_head)),
    ),
    cost_by_labels=True,
)

__all__ = ["Split", "SplitTrain", "SplitTrained", "madd"]
