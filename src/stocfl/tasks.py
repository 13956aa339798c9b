"""Client tasks: what an algorithm asks of a client, and what the client answers.

Tasks and results carry only flat float32 weight vectors, client ids and plain numbers, so
that every executor (in-process loop, batched ``vmap``, Flower messages) runs them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

import numpy as np
import torch

from stocfl.aggregation import weighted_mean


@dataclass(frozen=True, eq=False)
class Train:
    """Local SGD from ``weights``: ``epochs`` passes over the client's train set in shuffled
    mini-batches of ``batch_size`` (0 = full batch) with learning rate ``lr``, minimising
    f_i(w) + (prox_weight / 2) * ||w - prox_center||^2 (the proximal term is off when
    ``prox_center`` is None). ``seed`` fixes the mini-batch order."""

    client: int
    weights: torch.Tensor
    epochs: int
    batch_size: int
    lr: float
    seed: int
    prox_center: torch.Tensor | None = None
    prox_weight: float = 0.0


@dataclass(frozen=True, eq=False)
class Evaluate:
    """Mean loss and accuracy of ``weights`` on the client's ``split`` data."""

    client: int
    weights: torch.Tensor
    split: Literal["train", "test"] = "test"


@dataclass(frozen=True, eq=False)
class Gradient:
    """Gradient of the mean loss of ``weights`` on the client's whole train set."""

    client: int
    weights: torch.Tensor


@dataclass(frozen=True, eq=False)
class Represent:
    """The client's data representation Psi(D) from a fixed anchor model (StoCFL).

    ``kind="gradient"``: g = the gradient of the mean loss of ``anchor`` on the whole train
    set; ``kind="update"`` (the StoCFL authors' code): g = anchor - (anchor after ``epochs``
    epochs of local SGD with ``batch_size``, ``lr``, ``seed``). ``anchor_model="train"`` is the
    run's model; ``"linear"`` a linear softmax model on the raw inputs. If ``dim`` > 0 the
    client sends a seeded count-sketch projection of g to ``dim`` numbers (``projection_seed``,
    the same for every client). The result is normalised to unit length."""

    client: int
    anchor: torch.Tensor
    kind: Literal["gradient", "update"] = "gradient"
    anchor_model: Literal["train", "linear"] = "train"
    epochs: int = 20
    batch_size: int = 50
    lr: float = 0.1
    seed: int = 0
    dim: int = 0
    projection_seed: int = 0


@dataclass(frozen=True, eq=False)
class Trained:
    weights: torch.Tensor
    n_samples: int


@dataclass(frozen=True)
class Evaluated:
    loss: float
    correct: int
    n_samples: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n_samples if self.n_samples else 0.0


@dataclass(frozen=True, eq=False)
class Gradiented:
    gradient: torch.Tensor
    n_samples: int


@dataclass(frozen=True, eq=False)
class Represented:
    psi: torch.Tensor  # unit vector, or all zeros when the gradient vanished
    n_samples: int


T = TypeVar("T")

MAX_ABS = 1e6  # no trained weight or gradient entry is larger; a reply beyond it is refused


class BadResult(ValueError):
    """A client's result that must not be used (wrong shape or count, NaN, out of bounds)."""


def check_vector(t, what: str, n: int, bound: float = float("inf")) -> torch.Tensor:
    """``t`` if it is a float vector of length ``n`` with finite entries within +-``bound``,
    else :class:`BadResult` (one pass over the entries: max |t| is NaN or inf if any is)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n or not t.is_floating_point():
        raise BadResult(f"{what} has shape {tuple(getattr(t, 'shape', ()))}, expected ({n},) floats")
    top = float(t.abs().max()) if n else 0.0
    if not np.isfinite(top):
        raise BadResult(f"{what} holds NaN or inf")
    if top > bound:
        raise BadResult(f"{what} reaches {top:.3g}, beyond {bound:g}")
    return t


def check_result(task, result, train_size: int, test_size: int):
    """``result`` checked against what the server asked (``task``) and knows (the client's
    train and test sizes); returns it (a Psi re-normalised to unit length) or raises
    :class:`BadResult` naming the problem."""
    def count(n, expected, what):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n != expected:
            raise BadResult(f"{what} = {n!r}, but the client holds {expected}")

    if isinstance(task, Train) and isinstance(result, Trained):
        check_vector(result.weights, "weights", task.weights.numel(), MAX_ABS)
        count(result.n_samples, train_size, "n_samples")
    elif isinstance(task, Evaluate) and isinstance(result, Evaluated):
        count(result.n_samples, train_size if task.split == "train" else test_size, "n_samples")
        c = result.correct
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c <= result.n_samples:
            raise BadResult(f"correct = {c!r}, expected an integer in 0..{result.n_samples}")
        if not (isinstance(result.loss, (int, float)) and np.isfinite(result.loss) and result.loss >= 0):
            raise BadResult(f"loss = {result.loss!r}, expected a finite number >= 0")
    elif isinstance(task, Represent) and isinstance(result, Represented):
        psi = check_vector(result.psi, "representation", task.dim or task.anchor.numel())
        count(result.n_samples, train_size, "n_samples")
        norm = float(psi.double().norm())
        result = Represented((psi.double() / norm).float() if norm > 0 else psi, result.n_samples)
    elif isinstance(task, Gradient) and isinstance(result, Gradiented):
        check_vector(result.gradient, "gradient", task.weights.numel(), MAX_ABS)
        count(result.n_samples, train_size, "n_samples")
    else:
        raise BadResult(f"a {type(result).__name__} in reply to a {type(task).__name__} task")
    return result


class ClientsDropped(Exception):
    """Raised by an executor after a task list when some clients failed (an error, a bad reply,
    no reply in time). The round is redone without them; every other task in the list ran."""

    def __init__(self, clients: list[int], reasons: list[str]):
        super().__init__(f"dropped clients {clients}: {'; '.join(reasons)}")
        self.clients, self.reasons = clients, reasons


def without_dropped(clients: list[int], attempt: Callable[[list[int]], T]) -> tuple[list[int], T]:
    """``attempt(clients)``, repeated without the clients that failed until none fails; returns
    the clients that answered and the result (for steps that simply leave failed clients out)."""
    while True:
        try:
            return clients, attempt(clients)
        except ClientsDropped as err:
            clients = [i for i in clients if i not in err.clients]


Task = Train | Evaluate | Gradient | Represent
Result = Trained | Evaluated | Gradiented | Represented


def count_sketch(v: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
    """A seeded count-sketch random projection R v with R of shape (dim, len(v)): coordinate j
    goes to bucket h(j) with sign s(j). Inner products are preserved in expectation
    (E <Rx, Ry> = <x, y>); the same (dim, seed, len) gives the same R on every client."""
    g = torch.Generator().manual_seed(int(seed))
    buckets = torch.randint(0, dim, (v.numel(),), generator=g)
    signs = torch.randint(0, 2, (v.numel(),), generator=g).to(v.dtype).mul_(2).sub_(1)
    return torch.zeros(dim, dtype=v.dtype).index_add_(0, buckets, v * signs)


def batch_plan(n: int, epochs: int, batch_size: int, seed: int) -> list[list[torch.Tensor] | None]:
    """Per epoch, the mini-batches as index tensors; ``None`` for a full-batch epoch.

    Every executor takes the order from here, which is why they agree to float rounding."""
    if batch_size == 0 or batch_size >= n:
        return [None] * epochs
    g = torch.Generator().manual_seed(int(seed))
    return [list(torch.split(torch.randperm(n, generator=g), batch_size)) for _ in range(epochs)]


def task_seed(run_seed: int, round_: int, client: int, purpose: int = 0) -> int:
    """A seed for one client's task in one round, independent of every other draw."""
    return int(np.random.SeedSequence([run_seed, round_, client, purpose]).generate_state(1)[0])


def average(results: list[Trained]) -> torch.Tensor:
    """The mean of trained models weighted by the samples that trained them (FedAvg's rule)."""
    return weighted_mean([r.weights for r in results], [r.n_samples for r in results])
