"""The mixture family's client computations (FedEM; FedRC's weighting through ``label_bias``;
FedSoft's hard shares and proximal model): K models go down, each train sample's
responsibilities come from the K models' losses, and either the K models trained with those
per-sample weights or the client's own model trained toward them come back with the client's
new mixture weights; and the evaluation of a client that predicts with a mixture of K models.

Both are registered task kinds (``train.mixture``, ``evaluate.mixture``): every executor runs
them (the batched one through its vectorised training, :mod:`stocfl.executors.batched`), and the
Flower codec carries them from their fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from stocfl.bounds import MAX_WEIGHT
from stocfl.client.models import FlatModel
from stocfl.client.tasks import (
    BadResult,
    ClientData,
    Evaluate,
    Evaluated,
    _count,
    check_evaluated,
    check_vector,
    largest_change,
    largest_entry,
    register_task,
)
from stocfl.client.training import LocalTraining, local_sgd
from stocfl.errors import UserError

MIXTURE_TOLERANCE = 1e-3  # how far from 1 a reply's mixture weights may sum (float32 rounding)
PROB_FLOOR = 1e-10  # the least mixture probability a log is taken of (a component a client never uses)


@dataclass(frozen=True, eq=False)
class Mixture:
    """A client's predictor as a mixture: p(y | x) = sum_m weights[m] softmax(h_{models[m]}(x))_y
    (FedEM's prediction rule). ``models`` is (K, P), ``weights`` (K,) on the simplex. An
    algorithm's ``client_models`` may hand one out in place of a weights vector."""

    models: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True, eq=False)
class MixtureTrain:
    """One round of EM on one client (FedEM, Marfoq et al., NeurIPS 2021, Algorithm 1), or of
    FedSoft's proximal local updating (Ruan and Joe-Wong, AAAI 2022, Algorithm 1).

    E-step, with the models as sent: for each train sample s and model m,
    log q_s(m) = log prior[m] - l(h_m(x_s), y_s) + label_bias[m, y_s] + const, normalised over m
    (``prior`` None: 1/K each; ``label_bias`` None: 0; FedRC sends -log P_m(y)); ``assign =
    "hard"`` puts each sample wholly on its most likely model (the first of equals): with no
    prior, the model of least loss, FedSoft's count. Iterated ``em_steps`` times with
    prior <- mean_s q_s in between (the losses do not change while the models do not, so this
    is local: 1 is FedEM's round; more finds a new client's weights). The new mixture weights
    are pi = mean_s q_s(m); a model no sample weighs gets ``smoother`` (FedSoft's sigma), and pi
    is normalised again.

    M-step, without ``personal``: every model m trains from ``models[m]`` as ``local`` says on
    sum_{s in B} q_s(m) l(h_m(x_s), y_s) / |B| (the authors' code's weighting), all K in the
    mini-batch order that ``seed`` fixes; K models come back. With ``personal`` (the client's
    own model): that one model trains on f_i(w) + (mu/2) sum_m pi_m ||w - models[m]||^2,
    whose gradient is that of (mu/2) ||w - sum_m pi_m models[m]||^2 (pi sums to 1), so it
    trains as FedProx toward the pi-weighted centre; one model comes back.
    ``local.epochs = 0`` trains nothing: the E-step alone."""

    client: int
    models: torch.Tensor
    local: LocalTraining
    seed: int
    prior: torch.Tensor | None = None
    label_bias: torch.Tensor | None = None
    em_steps: int = 1
    assign: Literal["soft", "hard"] = "soft"
    smoother: float = 0.0
    personal: torch.Tensor | None = None
    mu: float = 0.0


@dataclass(frozen=True, eq=False)
class MixtureTrained:
    models: torch.Tensor  # (K, P): the K models after the M-step; (1, P): the client's own model
    mixture: torch.Tensor  # (K,): mean_s q_s, the client's new mixture weights
    label_mass: torch.Tensor  # (K, C): sum of q_s(m) over the samples of label c
    n_samples: int


@dataclass(frozen=True, eq=False)
class EvaluateMixture:
    """Mean loss (-log of the mixture's probability of the label) and accuracy (argmax of the
    mixture's probabilities) of ``Mixture(models, weights)`` on the client's ``split`` data."""

    client: int
    models: torch.Tensor
    weights: torch.Tensor
    split: Literal["train", "test"] = "test"


def evaluation_task(client: int, model, split: Literal["train", "test"] = "test"):
    """The task that evaluates ``model`` on the client: :class:`~stocfl.client.tasks.Evaluate`
    for a weights vector, :class:`EvaluateMixture` for a :class:`Mixture`."""
    if isinstance(model, Mixture):
        return EvaluateMixture(client, model.models, model.weights, split)
    return Evaluate(client, model, split)


def check_mixture_task(t: MixtureTrain, n_params: int, n_classes: int) -> None:
    k = len(t.models) if t.models.dim() == 2 else 0
    if t.models.dim() != 2 or t.models.shape[1] != n_params or k < 1:
        raise UserError(
            f"mixture task for client {t.client}: models have shape {tuple(t.models.shape)}, expected "
            f"(K, {n_params}) with K >= 1"
        )
    if t.prior is not None and t.prior.shape != (k,):
        raise UserError(f"mixture task for client {t.client}: prior has shape {tuple(t.prior.shape)}, expected ({k},)")
    if t.label_bias is not None and t.label_bias.shape != (k, n_classes):
        raise UserError(
            f"mixture task for client {t.client}: label_bias has shape {tuple(t.label_bias.shape)}, "
            f"expected ({k}, {n_classes})"
        )
    if t.em_steps < 1:
        raise UserError(f"mixture task for client {t.client}: em_steps = {t.em_steps}, expected >= 1")
    if t.assign not in ("soft", "hard"):
        raise UserError(f"mixture task for client {t.client}: assign = {t.assign!r}, expected 'soft' or 'hard'")
    if not 0.0 <= t.smoother < 1.0:
        raise UserError(f"mixture task for client {t.client}: smoother = {t.smoother}, expected 0 <= smoother < 1")
    if t.personal is not None and t.personal.shape != (n_params,):
        raise UserError(
            f"mixture task for client {t.client}: personal has shape {tuple(t.personal.shape)}, expected ({n_params},)"
        )
    if not (0.0 <= t.mu <= MAX_WEIGHT):
        raise UserError(f"mixture task for client {t.client}: mu = {t.mu}, expected 0 <= mu <= {MAX_WEIGHT:g}")
    if t.mu and t.personal is None:
        raise UserError(f"mixture task for client {t.client}: mu = {t.mu} needs a personal model to train")


@torch.no_grad()
def sample_losses(model: FlatModel, models: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(K, n): the loss of every model on every sample (evaluation mode, as evaluation is)."""
    out = torch.empty((len(models), len(y)), dtype=torch.float32, device=x.device)
    xl = model.layout(x)
    chunk = model.eval_chunk(x)
    for m, w in enumerate(models):
        for a in range(0, len(y), chunk):
            out[m, a : a + chunk] = model.per_sample_loss(model.forward(w, xl[a : a + chunk]), y[a : a + chunk])
    return out


def responsibilities(
    losses: torch.Tensor,
    y: torch.Tensor,
    prior: torch.Tensor | None,
    label_bias: torch.Tensor | None,
    steps: int,
    assign: str = "soft",
    smoother: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The E-step: q (K, n) and the mixture weights mean_s q_s (K,), from the per-sample
    ``losses`` (K, n); see :class:`MixtureTrain`. In float64: a softmax over a few models of
    losses up to hundreds is exact enough there, and float32 rounding would differ by engine."""
    k = len(losses)
    score = -losses.double()
    if label_bias is not None:
        score = score + label_bias.double()[:, y]
    pi = torch.full((k,), 1.0 / k, dtype=torch.float64, device=losses.device) if prior is None else prior.double()
    q = score
    for _ in range(steps):
        q = torch.log(pi.clamp(min=PROB_FLOOR))[:, None] + score
        if assign == "hard":  # argmax takes the first of equal scores
            q = torch.zeros_like(q).scatter_(0, q.argmax(0, keepdim=True), 1.0)
        else:
            q = torch.softmax(q, dim=0)
        pi = q.mean(1) if q.shape[1] else pi
    if smoother:
        pi = torch.where(pi == 0, torch.full_like(pi, smoother), pi)
        pi = pi / pi.sum()
    return q, pi


def label_mass(q: torch.Tensor, y: torch.Tensor, n_classes: int) -> torch.Tensor:
    """(K, C): sum_s q_s(m) [y_s = c]."""
    return torch.zeros((len(q), n_classes), dtype=torch.float64, device=q.device).index_add_(1, y, q)


def e_step(
    model: FlatModel, t: MixtureTrain, x: torch.Tensor, y: torch.Tensor, n_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The task checked, then its E-step on ``(x, y)``: the per-sample weights q (K, n,
    float32, for training), the new mixture weights (K,) and the label masses (K, C)."""
    check_mixture_task(t, model.n_params, n_classes)
    losses = sample_losses(model, t.models, x, y)
    q, pi = responsibilities(losses, y, t.prior, t.label_bias, t.em_steps, t.assign, t.smoother)
    return q.float(), pi.float(), label_mass(q, y, n_classes).float()


def proximal_center(models: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
    """sum_m pi_m models[m] (P,): where the personal model's proximal term pulls (in float64,
    the same on every engine)."""
    return (pi.double() @ models.double()).float()


def mixture_train(c: ClientData, t: MixtureTrain) -> MixtureTrained:
    """The reference: the E-step, then each model's weighted local SGD one after another (or
    the personal model's proximal training)."""
    q, pi, mass = e_step(c.model, t, c.x, c.y, c.n_classes)
    if t.personal is not None:
        center = proximal_center(t.models, pi)
        own = local_sgd(c.model, c.x, c.y, t.personal, t.local, t.seed, center=center, mu=t.mu)
        return MixtureTrained(own[None], pi, mass, len(c.y))
    trained = torch.stack(
        [local_sgd(c.model, c.x, c.y, w, t.local, t.seed, sample_weights=q[m]) for m, w in enumerate(t.models)]
    )
    return MixtureTrained(trained, pi, mass, len(c.y))


def check_mixture_trained(t: MixtureTrain, r: MixtureTrained, train_size: int, test_size: int) -> MixtureTrained:
    k, p = t.models.shape
    rows = 1 if t.personal is not None else k
    if not isinstance(r.models, torch.Tensor) or r.models.shape != (rows, p) or not r.models.is_floating_point():
        raise BadResult(f"models has shape {tuple(getattr(r.models, 'shape', ()))}, expected ({rows}, {p}) floats")
    check_vector(r.models.reshape(-1), "models", rows * p)  # their size is bounded by out_of_bound
    _count(r.n_samples, train_size, "n_samples")
    pi = check_vector(r.mixture, "mixture", k)
    if float(pi.min()) < 0 or abs(float(pi.sum()) - 1.0) > MIXTURE_TOLERANCE:
        raise BadResult(f"mixture {pi.tolist()} is not a distribution over the {k} models")
    mass = r.label_mass
    if not isinstance(mass, torch.Tensor) or mass.dim() != 2 or len(mass) != k:
        raise BadResult(f"label_mass has shape {tuple(getattr(mass, 'shape', ()))}, expected ({k}, classes)")
    check_vector(mass.reshape(-1), "label_mass", mass.numel(), float(train_size) * (1 + MIXTURE_TOLERANCE))
    if float(mass.min()) < 0 or abs(float(mass.sum()) - train_size) > MIXTURE_TOLERANCE * max(1, train_size):
        raise BadResult(f"label_mass sums to {float(mass.sum()):.6g}, but the client holds {train_size} samples")
    # the server uses the weights as a distribution: rounding is taken out, never trusted
    return MixtureTrained(r.models, pi / pi.sum(), mass, r.n_samples)


@torch.no_grad()
def mixture_probabilities(model: FlatModel, models: torch.Tensor, weights: torch.Tensor, x: torch.Tensor):
    """sum_m weights[m] softmax(h_m(x)): (n, C)."""
    xl = model.layout(x)
    p = None
    for w, pi in zip(models, weights.tolist()):
        part = torch.softmax(model.forward(w, xl), dim=1) * pi
        p = part if p is None else p + part
    return p


def mixture_evaluated(model: FlatModel, mixture: Mixture, x: torch.Tensor, y: torch.Tensor) -> Evaluated:
    """Mean loss, -log of the mixture's probability of the label, and correct count (argmax of
    the mixture's probabilities) of ``mixture`` on ``(x, y)``."""
    if len(y) == 0:
        return Evaluated(0.0, 0, 0)
    chunk = model.eval_chunk(x)
    loss, correct = 0.0, 0
    for a in range(0, len(y), chunk):
        p = mixture_probabilities(model, mixture.models, mixture.weights, x[a : a + chunk])
        yb = y[a : a + chunk]
        loss += float(-torch.log(p[torch.arange(len(yb)), yb].double().clamp(min=PROB_FLOOR)).sum())
        correct += int((p.argmax(1) == yb).sum())
    return Evaluated(loss / len(y), correct, len(y))


def evaluate_mixture(c: ClientData, t: EvaluateMixture) -> Evaluated:
    return mixture_evaluated(c.model, Mixture(t.models, t.weights), *c.split(t.split))


def check_mixture_evaluated(t: EvaluateMixture, r: Evaluated, train_size: int, test_size: int) -> Evaluated:
    return check_evaluated(Evaluate(t.client, t.models, t.split), r, train_size, test_size)


# a reply: K models, K weights and K x C label masses, C below a model's size
def moved_mixture(t: MixtureTrain, r: MixtureTrained) -> tuple[float, float]:
    """The models' largest change from those they trained from (the client's own model, or the
    K sent), beside the largest entry of what was sent."""
    sent = t.models if t.personal is None else t.personal.reshape(1, -1)
    return largest_change(r.models, sent), largest_entry(sent)


register_task(
    MixtureTrain,
    MixtureTrained,
    mixture_train,
    "train.mixture",
    check_mixture_trained,
    reply_size=lambda t: 2 * t.models.numel() + len(t.models),
    moved=moved_mixture,
)
register_task(
    EvaluateMixture, Evaluated, evaluate_mixture, "evaluate.mixture", check_mixture_evaluated, reply_size=lambda t: 0
)
