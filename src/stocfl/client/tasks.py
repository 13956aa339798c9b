"""Client tasks: what an algorithm asks of a client, and what the client answers.

A task kind is a dataclass (its fields are its message: flat float32 tensors, the client id,
plain numbers and strings, and frozen dataclasses of these such as the local-training
settings), its result dataclass, and one reference function that runs it on
one client's data (:func:`register_task`). Every executor dispatches through the registry: an
executor may have a faster path for a kind (the batched executor's training, the shared
evaluation of clients on one model), otherwise the reference runs; the Flower codec derives
its records from the dataclass fields. Training and evaluation are registered here; StoCFL's
representation beside StoCFL (``stocfl.algorithms.stocfl.representation``).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Literal, TypeVar

import numpy as np
import torch

from stocfl.client.models import FlatModel
from stocfl.client.training import LocalTraining, local_sgd
from stocfl.errors import UserError, refuse_builtin

log = logging.getLogger("stocfl")


@dataclass(frozen=True, eq=False)
class Train:
    """Local training from ``weights`` as ``local`` says (E epochs of shuffled mini-batches of B
    with its optimizer, :class:`~stocfl.client.training.LocalTraining`), minimising
    f_i(w) + (prox_weight / 2) * ||w - prox_center||^2 (the proximal term is off when
    ``prox_center`` is None). ``seed`` fixes the mini-batch order."""

    client: int
    weights: torch.Tensor
    local: LocalTraining
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
class Trained:
    weights: torch.Tensor
    n_samples: int


class FactoredTrained(Trained):
    """A :class:`Train` reply of the low-rank path (``run.factored_replies``) kept as its
    factors: the first layer, the first h*d entries of the flat weights, is

        alpha W_0 + beta C + A^T X

    with W_0 the weights sent (``start``: the executor's copy of them, which nothing writes
    into), C the proximal center (None: no pull; also a copy), X the
    client's flattened inputs (n x d) and A (n x h) the updates SGD accumulated on them; the
    other entries (``tail``) as trained. ``weights`` forms the dense model on first use (and
    keeps it); the mean rule aggregates such replies from their factors, one product for all
    of them (:func:`~stocfl.algorithms.aggregation.weighted_mean`), and their checks bound
    the move from the factors (:func:`check_trained`), so a round whose algorithm only
    averages them never forms them. Only the in-process executors make them; on an
    accelerator the factors stay there, and the mean is taken there."""

    start: torch.Tensor
    center: torch.Tensor | None
    alpha: float
    beta: float
    A: torch.Tensor
    X: torch.Tensor
    tail: torch.Tensor
    _dense: torch.Tensor | None
    _versions: tuple[int, int | None]

    def __init__(
        self,
        start: torch.Tensor,
        center: torch.Tensor | None,
        alpha: float,
        beta: float,
        A: torch.Tensor,
        X: torch.Tensor,
        tail: torch.Tensor,
        n_samples: int,
    ):
        for name, value in (
            ("start", start),
            ("center", center),
            ("alpha", float(alpha)),
            ("beta", float(beta)),
            ("A", A),
            ("X", X),
            ("tail", tail),
            ("n_samples", n_samples),
            ("_dense", None),
            ("_versions", (start._version, None if center is None else center._version)),
        ):
            object.__setattr__(self, name, value)

    @property
    def hd(self) -> int:
        return self.A.shape[1] * self.X.shape[1]

    @property
    def weights(self) -> torch.Tensor:
        """The dense weights, on the host (where the server's state lives)."""
        dense = self._dense
        if dense is None:
            dense = self.form().cpu()
            object.__setattr__(self, "_dense", dense)
        return dense

    def unchanged(self) -> FactoredTrained:
        """Itself, after checking that W_0 and C are still what it was trained from (an algorithm
        replaces its models, w = new; one written in place would change this reply)."""
        center = None if self.center is None else self.center._version
        if (self.start._version, center) != self._versions:
            raise RuntimeError(
                "a factored reply's start or center was changed in place after the reply was made; an "
                "algorithm replaces its models (w = new), it does not write into those it sent"
            )
        return self

    def form(self) -> torch.Tensor:
        """The dense weights, in the low-rank trainer's order: alpha W_0, + A^T X, + beta C."""
        self.unchanged()
        h, d = self.A.shape[1], self.X.shape[1]
        out = torch.empty_like(self.start)
        first = out[: h * d].view(h, d)
        torch.mul(self.start[: h * d].view(h, d), self.alpha, out=first)
        first.addmm_(self.A.T, self.X)
        if self.center is not None and self.beta != 0.0:
            first.add_(self.beta * self.center[: h * d].view(h, d))
        out[h * d :] = self.tail
        return out

    def move_bound(self) -> float:
        """An upper bound of max |weights - start| from the factors (inf or NaN where a factor
        holds one): |alpha - 1| max|W_0| + |beta| max|C| + max_j sum_n |A_nj| max|X| on the
        first layer, the exact largest change elsewhere."""
        hd = self.hd
        first = abs(self.alpha - 1.0) * largest_sent(self.start)
        if self.center is not None and self.beta != 0.0:
            first += abs(self.beta) * largest_sent(self.center)
        if self.A.numel():
            first += float(self.A.abs().sum(0).max()) * largest_entry(self.X)
        return max(first, largest_change(self.tail, self.start[hd:]))

    @property
    def nbytes(self) -> int:
        """What the reply is on the network: the dense weights."""
        return self.start.numel() * self.start.element_size()


@dataclass(frozen=True)
class Evaluated:
    loss: float
    correct: int
    n_samples: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.n_samples if self.n_samples else 0.0


T = TypeVar("T")

# Bounds on replies. Data statistics (descriptors, label counts, prototypes) are bounded in
# absolute terms by MAX_ABS. Replies in the model's own space (trained weights, gradients) are
# bounded relative to what was sent and to the task list's other replies (:func:`out_of_bound`):
# a model whose honest scale is large (a bias of 1e7, BatchNorm statistics of inputs of scale
# 1e4) passes, and the honest members of a cluster whose model a poisoned reply moved far are
# measured from that model, so the bound does not blame them for it.
MAX_ABS = 1e6


class BadResult(ValueError):
    """A client's result that must not be used (wrong shape or count, NaN, out of bounds)."""


def check_shape(t, what: str, n: int) -> torch.Tensor:
    """``t`` if it is a float vector of length ``n``, else :class:`BadResult`."""
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n or not t.is_floating_point():
        raise BadResult(f"{what} has shape {tuple(getattr(t, 'shape', ()))}, expected ({n},) floats")
    return t


def check_vector(t, what: str, n: int, bound: float = float("inf")) -> torch.Tensor:
    """``t`` if it is a float vector of length ``n`` with finite entries within +-``bound``,
    else :class:`BadResult` (one pass over the entries: max |t| is NaN or inf if any is)."""
    return check_entries(check_shape(t, what, n), what, largest_entry(t), bound)


def check_entries(t: torch.Tensor, what: str, top: float, bound: float = float("inf")) -> torch.Tensor:
    """``t`` if its largest entry ``top`` is finite and within ``bound``, else :class:`BadResult`."""
    if not np.isfinite(top):
        raise BadResult(f"{what} holds NaN or inf")
    if top > bound:
        raise BadResult(f"{what} reaches {top:.3g}, beyond {bound:g}")
    return t


def _count(n, expected: int, what: str) -> None:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n != expected:
        raise BadResult(f"{what} = {n!r}, but the client holds {expected}")


def check_trained(task: Train, result: Trained, train_size: int, test_size: int) -> Trained:
    moves = _MOVES.get()
    if isinstance(result, FactoredTrained) and result.start.shape == task.weights.shape:
        # a finite bound of the move means every entry finite; out_of_bound takes the exact move
        # where the bound could decide (its verdicts are the dense reply's)
        bound = result.move_bound()
        if np.isfinite(bound):
            if moves is not None:
                moves[id(result)] = (result, bound, False)
            _count(result.n_samples, train_size, "n_samples")
            return result
    w = check_shape(result.weights, "weights", task.weights.numel())  # its size is bounded by out_of_bound
    if moves is not None and w.shape == task.weights.shape:  # one pass: its entries and its move
        top, move = largest_entry_and_change(w, task.weights)
        check_entries(w, "weights", top)
        moves[id(result)] = (result, move, True)
    else:
        check_entries(w, "weights", largest_entry(w))
    _count(result.n_samples, train_size, "n_samples")
    return result


BLOCK = 1 << 18  # entries of a block that a reply's check reads at a time (1 MB: in a core's cache)


def largest_entry(t: torch.Tensor) -> float:
    """max |t| (NaN where t holds one, inf where it holds one), in one pass and no copy."""
    if not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t)
    return float(torch.maximum(-lo, hi))  # torch.maximum passes a NaN on, Python's max need not


def largest_change(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (NaN where either holds one), a block at a time: a model-sized difference is
    never made (a round's checks would write and read one per reply)."""
    if a.shape != b.shape:  # broadcast (a list of models against one): as written
        return largest_entry(a - b)
    return _largest_by_blocks(a, b, entry=False)[1]


def largest_entry_and_change(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a|, max |a - b|) of two vectors of one shape, in one pass over them: each block of
    ``a`` is read once for both (a reply's checks read it once, not twice)."""
    return _largest_by_blocks(a, b, entry=True)


def _largest_by_blocks(a: torch.Tensor, b: torch.Tensor, entry: bool) -> tuple[float, float]:
    """(max |a| if ``entry`` else 0, max |a - b|) over blocks of BLOCK entries, in cache. Each
    block's extremes are kept and reduced once at the end (max |x| is max(-min x, max x), a NaN
    passed on), and every block's difference is written into one buffer: three operations a
    block, each of which costs a round's worth of overhead when a round checks hundreds of
    replies."""
    a, b = a.reshape(-1), b.reshape(-1)
    if not a.numel():
        return 0.0, 0.0
    tops: list[torch.Tensor] = []
    moves: list[torch.Tensor] = []
    diff = torch.empty(min(a.numel(), BLOCK), dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    for s in range(0, a.numel(), BLOCK):
        part = a[s : s + BLOCK]
        if entry:
            tops += torch.aminmax(part)
        d = diff[: len(part)]
        torch.sub(part, b[s : s + BLOCK], out=d)
        moves += torch.aminmax(d)
    top = float(torch.stack(tops).abs().max()) if entry else 0.0
    return top, float(torch.stack(moves).abs().max())


# A Train reply's move, measured by its check inside :func:`checking` (id of the reply -> the
# reply, kept so that its id is not reused meanwhile, its move, and whether that is the move
# itself or an upper bound of it: a factored reply's).
_MOVES: contextvars.ContextVar[dict[int, tuple[Any, float, bool]] | None] = contextvars.ContextVar(
    "stocfl_reply_moves", default=None
)


@contextlib.contextmanager
def checking():
    """The scope of one list of replies' checks and :func:`out_of_bound`: a trained model's move
    from what was sent is measured in the pass its check reads it in, and used by the bound."""
    token, sent = _MOVES.set({}), _SENT.set({})  # the scale of a model sent to many found once
    try:
        yield
    finally:
        _SENT.reset(sent)
        _MOVES.reset(token)


_SENT: contextvars.ContextVar[dict[tuple[int, int], tuple[torch.Tensor, float]] | None] = contextvars.ContextVar(
    "stocfl_sent_scales", default=None
)


def largest_sent(t: torch.Tensor) -> float:
    """:func:`largest_entry` of a tensor a task sent: within one :func:`out_of_bound` it is found
    once per tensor (a round sends one global model to hundreds of clients)."""
    cache = _SENT.get()
    if cache is None:
        return largest_entry(t)
    key = (id(t), t._version)
    if key not in cache:  # the tensor is kept with its scale: its id cannot be reused meanwhile
        cache[key] = (t, largest_entry(t))
    return cache[key][1]


def moved_trained(task: Train, result: Trained) -> tuple[float, float]:
    """(the largest change of the reply's weights from those sent, the sent weights' largest
    entry); a factored reply's is an upper bound of that change until :func:`out_of_bound`
    needs the change itself."""
    moves = _MOVES.get()
    known = None if moves is None else moves.get(id(result))
    move = known[1] if known is not None and known[0] is result else largest_change(result.weights, task.weights)
    return move, largest_sent(task.weights)


def _bounded_only(result: Any) -> bool:
    moves = _MOVES.get()
    known = None if moves is None else moves.get(id(result))
    return known is not None and known[0] is result and not known[2]


def out_of_bound(tasks: list, results: list) -> dict[int, str]:
    """The replies (by position) that moved too far, each with why. A reply of a kind with a
    ``moved`` measure (:class:`TaskKind`) moved by m from what was sent, whose largest entry is
    s; it is out of bound when m > MAX_ABS * max(1, s, M), M the median move of the list's other
    replies (the lower one of an even count; none: 0). Relative to the model, so an honest
    large-scale model passes; relative to the others, so a round whose every honest reply moves
    far (BatchNorm statistics on large inputs, in round 1) passes, while one reply far beyond
    the rest does not. A list of one reply has no others: only its model's scale bounds it."""
    moves = {}
    token = _SENT.set({})
    try:
        for k, (t, r) in enumerate(zip(tasks, results)):
            kind = kind_of(type(t))
            if kind.moved is not None:
                moves[k] = kind.moved(t, r)
        # factored replies carry a bound of their move. Where no move reaches MAX_ABS * max(1, its
        # scale), none is out of bound whatever the median: the bounds decide as the moves would.
        # Else the moves themselves, so that the medians and verdicts are the dense replies'.
        bounded = [k for k in moves if _bounded_only(results[k])]
        if bounded and any(m > MAX_ABS * max(1.0, scale) for m, scale in moves.values()):
            for k in bounded:
                moves[k] = (largest_change(results[k].weights, tasks[k].weights), moves[k][1])
    finally:
        _SENT.reset(token)
    order = sorted(moves, key=lambda k: moves[k][0])
    rank = {k: j for j, k in enumerate(order)}
    n_others = len(order) - 1
    mid = (n_others - 1) // 2  # the lower median's place among the others
    out = {}
    for k, (m, scale) in moves.items():
        median = 0.0 if n_others < 1 else moves[order[mid + (rank[k] <= mid)]][0]
        bound = MAX_ABS * max(1.0, scale, median)
        if m > bound:
            out[k] = (
                f"moved {m:.3g} from the model sent, beyond {MAX_ABS:g} x max(1, the model's largest entry "
                f"{scale:.3g}, the round's median move {median:.3g})"
            )
    return out


def check_evaluated(task: Evaluate, result: Evaluated, train_size: int, test_size: int) -> Evaluated:
    _count(result.n_samples, train_size if task.split == "train" else test_size, "n_samples")
    c = result.correct
    if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or not 0 <= c <= result.n_samples:
        raise BadResult(f"correct = {c!r}, expected an integer in 0..{result.n_samples}")
    # finite, not >= 0: a user's loss may be negative, and a client could bias a choice by loss as
    # much with 0 as with any negative number
    if isinstance(result.loss, bool) or not (isinstance(result.loss, (int, float)) and np.isfinite(result.loss)):
        raise BadResult(f"loss = {result.loss!r}, expected a finite number")
    return result


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def field_names(value: Any) -> tuple[str, ...]:
    """The field names of ``value``, a dataclass instance (anything else: none), found once per
    type: a round's bookkeeping (its traffic, its FLOP counts) asks them of every task and reply."""
    names = _FIELD_NAMES.get(type(value))
    if names is None:
        is_instance = is_dataclass(value) and not isinstance(value, type)
        names = _FIELD_NAMES[type(value)] = tuple(f.name for f in fields(value)) if is_instance else ()
    return names


def check_any(task, result, train_size: int, test_size: int):
    """The check of a kind registered without its own: every tensor finite, a count named
    ``n_samples`` equal to the client's train size."""
    for f in fields(result):
        v = getattr(result, f.name)
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() and not bool(torch.isfinite(v).all()):
            raise BadResult(f"{f.name} holds NaN or inf")
        if f.name == "n_samples":
            _count(v, train_size, "n_samples")
    return result


def check_result(task, result, train_size: int, test_size: int):
    """``result`` checked against what the server asked (``task``, by its kind's check) and
    knows (the client's train and test sizes); returns it (possibly normalised, e.g. a Psi
    re-scaled to unit length) or raises :class:`BadResult` naming the problem."""
    kind = kind_of(type(task))
    if not isinstance(result, kind.result):
        raise BadResult(f"a {type(result).__name__} in reply to a {type(task).__name__} task")
    return (kind.check or check_any)(task, result, train_size, test_size)


class ClientsDropped(Exception):
    """Raised by an executor after a task list when some clients failed (an error, a bad reply,
    no reply in time). The round is redone without them; every other task in the list ran."""

    def __init__(self, clients: list[int], reasons: list[str]):
        super().__init__(f"dropped clients {clients}: {'; '.join(reasons)}")
        self.clients, self.reasons = clients, reasons

    def summary(self) -> str:
        """The reasons on one line, clients that failed alike together: "40 clients (0-39): bad
        reply (loss = nan, ...)" rather than forty copies of it."""
        return grouped_reasons(self.reasons)


def grouped_reasons(reasons: list[str]) -> str:
    groups: dict[str, list[tuple[int, str]]] = {}
    alone = []
    for r in reasons:
        m = re.fullmatch(r"client (\d+)(?: \(node \d+\))?: (.*)", r, re.S)
        if m is None:
            alone.append(r)
        else:
            groups.setdefault(m.group(2), []).append((int(m.group(1)), r))
    said = [
        got[0][1] if len(got) == 1 else f"{len(got)} clients ({id_ranges([i for i, _ in got])}): {why}"
        for why, got in groups.items()
    ]
    return "; ".join(said + alone)


def id_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    out, ids = [], sorted(ids)
    start = prev = ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ",".join(out)


def without_dropped(
    clients: list[int], attempt: Callable[[list[int]], T], step: str, none_left: str | None = None
) -> tuple[list[int], T]:
    """``attempt(clients)``, repeated without the clients that failed until none fails; returns
    the clients that answered and the result (for steps that simply leave failed clients out).
    Every client left out is logged, naming ``step`` and why: a figure computed over fewer
    clients than asked must never pass unnoticed. ``none_left``: when every client failed, the
    step stops with one line, naming ``step`` and why, followed by ``none_left`` (what to do)."""
    reasons: list[str] = []
    while True:
        try:
            return clients, attempt(clients)
        except ClientsDropped as err:
            log.warning("%s: left out %s", step, err.summary())
            reasons += err.reasons
            clients = [i for i in clients if i not in err.clients]
            if not clients and none_left is not None:
                raise UserError(f"{step}: every client failed ({grouped_reasons(reasons)}); {none_left}") from None


def task_seed(run_seed: int, round_: int, client: int, purpose: int = 0) -> int:
    """A seed for one client's task in one round, independent of every other draw."""
    return int(np.random.SeedSequence([run_seed, round_, client, purpose]).generate_state(1)[0])


# ---- the registry -------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientData:
    """What a task's reference function sees: one client's train and test data and the run's
    model (a pure function of flat weights)."""

    client: int
    x: torch.Tensor
    y: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    model: FlatModel
    n_classes: int

    def split(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x, self.y) if name == "train" else (self.x_test, self.y_test)


@dataclass(frozen=True)
class TaskKind:
    """A client computation: ``reference(client_data, task) -> result`` is its reference function
    (what every engine runs, unless it has a faster path); ``check``
    validates a reply (default :func:`check_any`); ``batched(executor, tasks)``, when given, is
    a vectorised version the batched executor uses; ``message`` is its Flower message type;
    ``reply_size(task)`` bounds the numbers a reply to ``task`` may carry in its tensors, which
    a decoder checks before it reads them (default :func:`default_reply_size`); ``moved(task,
    result)``, for replies in the model's space, is (the reply's largest change from what was
    sent, the largest entry of what was sent), which :func:`out_of_bound` bounds;
    ``cost_by_labels``: the reference's arithmetic depends on the client's label counts (a
    per-label SVD, a class-balanced sample), so its FLOPs are counted per label histogram
    (:mod:`stocfl.client.flops`)."""

    task: type
    result: type
    reference: Callable[[ClientData, Any], Any]
    message: str
    check: Callable[[Any, Any, int, int], Any] | None = None
    batched: Callable[[Any, list], list] | None = None
    reply_size: Callable[[Any], int] | None = None
    moved: Callable[[Any, Any], tuple[float, float]] | None = None
    cost_by_labels: bool = False

    def max_reply(self, task) -> int:
        """The most numbers a reply to ``task`` may carry in its tensors."""
        return int((self.reply_size or default_reply_size)(task))


def default_reply_size(task) -> int:
    """A kind registered without ``reply_size``: twice the numbers its task carries, plus 2^16."""
    carried = sum(v.numel() for f in fields(task) if isinstance(v := getattr(task, f.name), torch.Tensor))
    return 2 * carried + 2**16


KINDS: dict[type, TaskKind] = {}
MESSAGE_CATEGORIES = ("train", "evaluate", "query")  # Flower's message categories
# the tasks of the built-in algorithms
BUILTIN_MESSAGES = (
    "train",
    "evaluate",
    "query.represent",
    "train.mixture",
    "evaluate.mixture",
    "query.gradient",
    "query.subspace",
    "query.describe",
    "train.split",
)


def register_task(
    task: type,
    result: type,
    reference: Callable[[ClientData, Any], Any],
    message: str | None = None,
    check: Callable | None = None,
    batched: Callable | None = None,
    reply_size: Callable | None = None,
    moved: Callable | None = None,
    cost_by_labels: bool = False,
) -> TaskKind:
    """Register a task kind (see :class:`TaskKind`). ``task`` and ``result`` are dataclasses; a
    task has a field ``client``. ``message`` defaults to ``query.<task name in lower case>``."""
    if not (isinstance(task, type) and is_dataclass(task) and isinstance(result, type) and is_dataclass(result)):
        raise UserError(f"register_task: task and result must be dataclasses, got {task!r} and {result!r}")
    if not callable(reference):
        raise UserError(f"register_task({task.__name__}): reference must be a function (client_data, task) -> result")
    if task in KINDS:
        refuse_builtin("register_task", task.__name__, KINDS[task].message in BUILTIN_MESSAGES)
    names = {f.name for f in fields(task)}
    if "client" not in names:
        raise UserError(f"register_task: {task.__name__} needs a field 'client' (the client that runs it)")
    message = message or f"query.{task.__name__.lower()}"
    category, _, action = message.partition(".")
    if category not in MESSAGE_CATEGORIES or not (action.isidentifier() or (not action and category != "query")):
        raise UserError(
            f"register_task({task.__name__}): message type {message!r} is not CATEGORY.ACTION with CATEGORY one "
            f"of {', '.join(MESSAGE_CATEGORIES)} and ACTION a Python identifier (Flower routes messages by both)"
        )
    taken = [k for k in KINDS.values() if k.message == message and k.task is not task]
    if taken:
        raise UserError(f"register_task: message type {message!r} is taken by {taken[0].task.__name__}")
    KINDS[task] = TaskKind(task, result, reference, message, check, batched, reply_size, moved, cost_by_labels)
    return KINDS[task]


def kind_of(task_type: type) -> TaskKind:
    try:
        return KINDS[task_type]
    except KeyError:
        raise UserError(
            f"{task_type.__name__} is not a registered task kind; register it with stocfl.client.tasks.register_task"
        ) from None


def kind_by_message(message: str) -> TaskKind:
    for k in KINDS.values():
        if k.message == message:
            return k
    raise ValueError(f"unknown message type {message!r}")


def check_weights(what: str, t, n_params: int) -> None:
    """A task's ``weights`` must be one flat vector of the model's size: one line naming the task
    kind (``what``) and the client otherwise."""
    if t.weights.shape != (n_params,):
        raise UserError(
            f"{what} task for client {t.client}: weights have shape {tuple(t.weights.shape)}, "
            f"the model has {n_params} parameters"
        )


def check_train_task(t: Train, n_params: int) -> None:
    check_weights("train", t, n_params)


def train_one(c: ClientData, t: Train) -> Trained:
    """The reference: local SGD on the client's train set (``stocfl.client.training.local_sgd``)."""
    check_train_task(t, c.model.n_params)
    w = local_sgd(c.model, c.x, c.y, t.weights, t.local, t.seed, t.prox_center, t.prox_weight)
    return Trained(w, len(c.y))


@torch.no_grad()
def evaluate_pooled(
    model: FlatModel, w: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[Evaluated]:
    """Loss and accuracy of one weights vector on each of several clients' data, in one forward
    pass over their concatenation (exact: the per-sample numbers do not depend on the batch)."""
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    losses, correct = [], []
    chunk = model.eval_chunk(x)
    for a in range(0, len(y), chunk):
        logits = model.forward(w, model.layout(x[a : a + chunk]))
        losses.append(model.per_sample_loss(logits, y[a : a + chunk]).double())
        correct.append(logits.argmax(1) == y[a : a + chunk])
    loss_all = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
    correct_all = torch.cat(correct) if correct else torch.zeros(0, dtype=torch.bool)
    out, start = [], 0
    for _, yk in parts:
        seg = slice(start, start + len(yk))
        out.append(Evaluated(float(loss_all[seg].mean()) if len(yk) else 0.0, int(correct_all[seg].sum()), len(yk)))
        start += len(yk)
    return out


def evaluate_one(c: ClientData, t: Evaluate) -> Evaluated:
    return evaluate_pooled(c.model, t.weights, [c.split(t.split)])[0]


register_task(
    Train, Trained, train_one, "train", check_trained, reply_size=lambda t: t.weights.numel(), moved=moved_trained
)
register_task(Evaluate, Evaluated, evaluate_one, "evaluate", check_evaluated, reply_size=lambda t: 0)

Task = Any  # an instance of a registered task kind
Reply = Any  # what a client sends back: an instance of its task kind's result type
