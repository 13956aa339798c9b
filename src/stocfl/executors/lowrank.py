"""Exact low-rank local training of a dense first layer.

SGD keeps the first Linear layer's update in the span of the client's inputs. With X the
client's flattened inputs (n x d), W_0 the first layer at the start and C its proximal center,

    W_t = alpha_t W_0 + beta_t C + A_t^T X            (A_t: n x h)

A step on mini-batch B with dL/dZ_B = G (|B| x h) and proximal weight mu gives
alpha <- s alpha, beta <- s beta + lr mu, A <- s A, A[B] <- A[B] - lr G, with s = 1 - lr mu,
and the batch's pre-activations are Z_B = alpha P_0[B] + beta P_C[B] + K[B] A + b, where
P_0 = X W_0^T, P_C = X C^T and K = X X^T are formed once. W_t is formed once at the end. A
step's first-layer work falls from |B| d h to |B| n h, a gain of about d / n when a client has
fewer samples than the layer has inputs (MNIST, |D| = 50: 784 / 50).

The same numbers as plain SGD up to float rounding (tested to 1e-5 relative in float32 and
1e-12 in float64, full batch and mini-batches, with and without a proximal term). It applies
to plain SGD (no momentum, weight decay or Adam: their steps leave the span) on models whose
first layer is an ``nn.Linear`` on the flattened input, followed by layers without buffers;
:func:`structure` says whether a model qualifies and :func:`flops` what each path costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import grad, vmap

from stocfl.client.models import FlatModel
from stocfl.client.training import batch_plan, stacked_batch


@dataclass(frozen=True)
class Structure:
    d: int  # inputs of the first layer
    h: int  # its outputs
    bias: bool
    tail: FlatModel  # the layers after it, as a function of its output


def structure(model: FlatModel) -> Structure | None:
    """How ``model`` splits into a first dense layer and the rest, or None when it does not."""
    m = model.module
    if model.has_buffers or not isinstance(m, nn.Sequential):
        return None
    layers = list(m)
    while layers and isinstance(layers[0], nn.Flatten):
        layers.pop(0)
    if len(layers) < 2 or not isinstance(layers[0], nn.Linear):
        return None
    first = layers[0]
    names = [n for n, _ in m.named_parameters()]
    own = 2 if first.bias is not None else 1
    if [t.shape for t in list(first.parameters())] != [tuple(model.shapes[k]) for k in range(own)] or len(names) < own:
        return None
    tail = FlatModel(nn.Sequential(*layers[1:]), model.loss)
    if tail.n_params + sum(model.numels[:own]) != model.n_params:
        return None
    return Structure(first.in_features, first.out_features, first.bias is not None, tail)


def tail_flops(s: Structure) -> float:
    """FLOPs of one sample's forward and backward through the layers after the first (the
    gradient of their input included: the first layer's update needs it), as torch's
    ``FlopCounterMode`` counts them (matrix products, two a multiply-add)."""
    from stocfl.client.flops import count_flops

    z = torch.zeros(2, s.h, requires_grad=True)
    w = torch.zeros(s.tail.n_params, requires_grad=True)
    y = torch.zeros(2, dtype=torch.long)

    def step():
        torch.autograd.grad(s.tail.mean_loss(s.tail.forward(w, z), y), (w, z))

    return count_flops(step) / 2


def flops(s: Structure, n: int, epochs: int, batch: int, prox_distinct: bool) -> tuple[float, float]:
    """FLOPs of local training on one client of ``n`` samples, (plain, low-rank), each path as
    it computes (a test counts both with ``FlopCounterMode``). Plain: per sample, the first
    layer's forward and its weights' gradient (4dh; the input needs no gradient) and the
    tail's (:func:`tail_flops`). Low-rank: P_0 = X W_0^T, P_C = X C^T (a proximal center other
    than the start) and K = X X^T once, W = alpha W_0 + beta C + A^T X at the end; per sample
    of a step, its row of K times A (2nh) and the tail."""
    per_sample_tail = tail_flops(s)
    plain = epochs * n * (4.0 * s.d * s.h + per_sample_tail)
    once = 2.0 * n * s.d * s.h * (3 if prox_distinct else 2) + 2.0 * n * n * s.d
    lowrank = once + epochs * n * (2.0 * n * s.h + per_sample_tail)
    return plain, lowrank


@dataclass(frozen=True)
class Factors:
    """A chunk's trained rows as the low-rank form holds them (c rows): the first layer
    alpha W_0 + beta C + A^T X, and the bias and later layers as trained."""

    alpha: torch.Tensor  # (c,)
    beta: torch.Tensor  # (c,)
    mu: torch.Tensor  # (c,): the proximal weights (a row with 0 has no center)
    A: torch.Tensor  # (c, n_max, h); a padded sample's rows are 0
    X: torch.Tensor  # (c, n_max, d), the flattened inputs
    b: torch.Tensor  # (c, h) or (c, 0)
    rest: torch.Tensor  # (c, P - h d - h)


class LowRankTrainer:
    """Plain-SGD local training of a stack of clients through the low-rank form (vmap over
    clients; padded samples weigh 0 and a client out of mini-batches is frozen)."""

    def __init__(self, s: Structure):
        self.s = s
        self.hd = s.h * s.d
        tail = s.tail

        def loss(z, rest, y, m):
            per_sample = tail.per_sample_loss(tail.forward(rest, z), y)
            return (per_sample * m).sum() / m.sum().clamp(min=1.0)

        def weighted_loss(z, rest, y, m, q):  # the mixture family's M-step: sum_b q_b l_b / |B|
            per_sample = tail.per_sample_loss(tail.forward(rest, z), y)
            return (per_sample * m * q).sum() / m.sum().clamp(min=1.0)

        self._grads = vmap(grad(loss, argnums=(0, 1)))
        self._weighted_grads = vmap(grad(weighted_loss, argnums=(0, 1)))

    def train(self, w: torch.Tensor, centers: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
        """Trained weights (c x P): :meth:`factors`' training (its arguments), with the first
        layer formed in ``w`` (trained in place and returned)."""
        f = self.factors(w, centers, *args, **kwargs)
        hd, nb = self.hd, f.b.shape[1]
        W0 = w[:, :hd].reshape(len(w), self.s.h, self.s.d)
        # W_0 is a view of w: the first layer is formed in place, in as few passes over it as possible
        if not bool((f.alpha == 1).all()):
            W0.mul_(f.alpha[:, None, None])
        W0.baddbmm_(f.A.transpose(1, 2), f.X)
        if centers is not None:  # row by row: a model-sized product at a time, none for a row without a center
            C = centers[:, :hd].reshape(len(w), self.s.h, self.s.d)
            for i in torch.nonzero(f.mu).flatten().tolist():
                W0[i].add_(f.beta[i] * C[i])
        w[:, hd : hd + nb] = f.b
        w[:, hd + nb :] = f.rest
        return w

    def factors(
        self,
        w: torch.Tensor,
        centers: torch.Tensor | None,
        mu: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        sizes: list[int],
        epochs: int,
        batch_size: int,
        lr: float,
        seeds: list[int],
        q: torch.Tensor | None = None,
        center_is_start: bool = False,
    ) -> Factors:
        """The factors of the trained rows from ``w`` (c x P, read, not written); ``x``
        (c x n_max x ...) padded, ``sizes`` the true sizes; ``centers`` (c x P) with weights
        ``mu`` (c), or None; ``q`` (c x n_max), each sample's weight in its loss, or None. The
        weights scale each sample's gradient with respect to its first-layer output, so the
        first layer's update stays in the span of the samples: the low-rank form holds.
        ``center_is_start``: every row's center is its start (FedProx), so X C^T is X W_0^T,
        formed once (told, not found by comparing two model-sized stacks)."""
        c, hd, h, d, dev = len(w), self.hd, self.s.h, self.s.d, w.device
        X = x.reshape(c, x.shape[1], -1).to(w.dtype)
        W0 = w[:, :hd].reshape(c, h, d)
        nb = h if self.s.bias else 0
        b = w[:, hd : hd + nb].clone()
        rest = w[:, hd + nb :].clone()
        P0 = torch.bmm(X, W0.transpose(1, 2))
        has_prox = centers is not None and bool((mu != 0).any())
        if has_prox and centers is not None:
            C = centers[:, :hd].reshape(c, h, d)
            PC = P0 if center_is_start else torch.bmm(X, C.transpose(1, 2))
            cb, crest = centers[:, hd : hd + nb], centers[:, hd + nb :]
        K = torch.bmm(X, X.transpose(1, 2))
        n_max = X.shape[1]
        A = torch.zeros(c, n_max, h, dtype=w.dtype, device=dev)
        alpha = torch.ones(c, dtype=w.dtype, device=dev)
        beta = torch.zeros(c, dtype=w.dtype, device=dev)
        mu = mu.to(dev, w.dtype) if has_prox else torch.zeros(c, dtype=w.dtype, device=dev)
        plans = [batch_plan(sizes[i], epochs, batch_size, seeds[i]) for i in range(c)]
        rows = torch.arange(c, device=dev)[:, None]
        full_mask = (torch.arange(n_max, device=dev)[None, :] < torch.tensor(sizes, device=dev)[:, None]).to(w.dtype)
        unpadded = min(sizes) == n_max  # a full batch's mask is all ones: multiplying by it changes nothing
        for e in range(epochs):
            steps = [1 if (plan_e := p[e]) is None else len(plan_e) for p in plans]
            whole = all(p[e] is None for p in plans)  # full batch: every row, in order, no gathering
            pick: Callable[[torch.Tensor], torch.Tensor]
            for st in range(max(steps)):
                if whole:
                    mask, pick = full_mask, (lambda t: t)
                else:
                    idx, mask = stacked_batch(plans, e, st, steps, sizes, dev)
                    mask = mask.to(w.dtype)

                    def pick(t: torch.Tensor, idx: torch.Tensor = idx) -> torch.Tensor:
                        return t[rows, idx]

                # alpha stays 1 without a proximal pull, and 1 * P0 is P0: no model-free pass over it
                start = pick(P0) if not has_prox else alpha[:, None, None] * pick(P0)
                z = torch.baddbmm(start, pick(K), A)
                if has_prox:
                    z.add_(beta[:, None, None] * pick(PC))
                if nb:
                    z.add_(b[:, None, :])
                if q is None:
                    gz, grest = self._grads(z, rest, pick(y), mask)
                else:
                    gz, grest = self._weighted_grads(z, rest, pick(y), mask, pick(q).to(w.dtype))
                active = torch.tensor([float(st < k) for k in steps], dtype=w.dtype, device=dev)
                step = lr * active
                shrink = 1.0 - step * mu
                alpha = alpha * shrink
                beta = beta * shrink + step * mu
                if has_prox:
                    A.mul_(shrink[:, None, None])
                gb = gz.sum(1)
                # gz is this step's own tensor: the update is formed in it, not in a temporary of
                # its size (a product of two floats is the same either way round)
                update = gz.mul_(-step[:, None, None])
                if not (whole and unpadded):
                    update.mul_(mask[:, :, None])
                if whole:
                    A.add_(update)
                else:  # accumulate: padded slots point at sample 0 too, and must not overwrite its update
                    A.index_put_((rows.expand_as(idx), idx), update, accumulate=True)
                if has_prox:
                    if nb:
                        gb = gb + mu[:, None] * (b - cb)
                    grest = grest + mu[:, None] * (rest - crest)
                if nb:
                    b = b - step[:, None] * gb
                rest = rest - step[:, None] * grest
        return Factors(alpha, beta, mu, A, X, b, rest)
