"""What every in-process executor shares: dispatch through the task-kind registry, and the
exact shared evaluation of clients that use one model."""

from __future__ import annotations

import hashlib
import warnings
from collections import defaultdict
from collections.abc import Callable

import torch

from stocfl.client.mixture import MixtureTrain
from stocfl.client.models import FlatModel
from stocfl.client.tasks import (
    ClientData,
    Evaluate,
    Evaluated,
    FactoredTrained,
    Reply,
    Task,
    Train,
    evaluate_pooled,
    kind_of,
)
from stocfl.data.federation import Federation
from stocfl.devices import federation_on, move
from stocfl.errors import UserError
from stocfl.executors.pool import available_bytes


class Executor:
    """Runs client tasks on a federation held in this process.

    Each kind of task runs through the executor's own faster path when it has one
    (:meth:`fast_paths`), else its registered reference function, client by client.
    Evaluation's path is exact: tasks that share one weights tensor (every client on the global
    model, the members of a cluster) are evaluated in one forward pass over their data.
    """

    name = "in-process"  # the run.engine it stands for

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__ and "execute" not in cls.__dict__:  # would never be called
            raise UserError(f"{cls.__name__}.run(tasks): an executor's method is now execute(tasks); rename it")

    def __init__(self, federation: Federation, model: FlatModel, device: str | torch.device = "cpu"):
        self.fed = federation
        self.model = model
        self.device = torch.device(device)
        self.data = federation_on(federation, self.device)  # the clients' data, on the device once

    def fast_paths(self) -> dict[type, Callable[[list], list]]:
        return {Evaluate: self.evaluate}

    def client(self, i: int) -> ClientData:
        x, y = self.data.train_data(i)
        xt, yt = self.data.test_data(i)
        return ClientData(i, x, y, xt, yt, self.model, self.fed.n_classes)

    def execute(self, tasks: list[Task]) -> list[Reply]:
        """One reply per task, in the tasks' order."""
        self.check_memory(tasks)
        out: list[Reply | None] = [None] * len(tasks)
        by_kind: dict[type, list[int]] = defaultdict(list)
        for k, t in enumerate(tasks):
            by_kind[type(t)].append(k)
        fast = self.fast_paths()
        memo: dict[int, torch.Tensor] = {}
        remote, cpu = self.device.type != "cpu", torch.device("cpu")
        for kind, idx in by_kind.items():
            batch = [tasks[k] for k in idx]
            if remote:
                batch = [move(t, self.device, memo) for t in batch]
            results = fast[kind](batch) if kind in fast else self.execute_reference(kind, batch)
            if len(results) != len(batch):  # a user's batched function: its missing results were replies of None
                raise UserError(
                    f"the {kind.__name__} tasks' batched path returned {len(results)} results for "
                    f"{len(batch)} tasks; it returns one result per task, in order"
                )
            for k, r in zip(idx, results):
                # a factored reply stays where it was trained: its mean is taken there, and only
                # the mean (or a reply an algorithm reads) comes to the host
                out[k] = move(r, cpu) if remote and not isinstance(r, FactoredTrained) else r
        return out

    def reply_bytes(self, tasks: list[Task]) -> int:
        """Bytes of the models that the replies to ``tasks`` carry (:func:`reply_bytes`)."""
        return reply_bytes(tasks)

    def reusable_bytes(self) -> int:
        """Memory this executor keeps for its next replies (a chunk pool's free tensors)."""
        return 0

    def check_memory(self, tasks: list[Task]) -> None:
        """:func:`check_reply_memory` with this executor's count of the replies and its memory
        kept for them."""
        check_reply_memory(tasks, self.reply_bytes(tasks), self.reusable_bytes)

    def run(self, tasks: list[Task]) -> list[Reply]:
        """Renamed :meth:`execute`; kept for programs that call it."""
        warnings.warn("Executor.run(tasks) is now Executor.execute(tasks)", DeprecationWarning, stacklevel=2)
        return self.execute(tasks)

    def release(self) -> None:
        """Give back memory kept from round to round (the batched engines' chunk pool); the
        executor stays usable. A run calls it when it stops."""

    def execute_reference(self, kind: type, tasks: list[Task]) -> list[Reply]:
        """Tasks of one kind through its registered reference function, client by client."""
        ref = kind_of(kind).reference
        return [ref(self.client(t.client), t) for t in tasks]

    # Evaluations are computed once: a (client, split, weights) evaluated before is answered
    # from memory, the weights known by their content (a model trained in place is another
    # model). IFCA's models that no client chose, FL+HC's frozen global model, the personal
    # models of clients not sampled are scored again every evaluation otherwise. Exact: the
    # pooled evaluation's numbers of a client do not depend on the clients pooled with it.
    memo_evaluations = True
    MEMO_ENTRIES = 1 << 18  # forgotten all at once beyond this (a long run of ever new models)

    def evaluate(self, tasks: list[Evaluate]) -> list[Evaluated]:
        out: list[Evaluated | None] = [None] * len(tasks)
        keys: list[tuple | None] = [None] * len(tasks)
        memo: dict[tuple, Evaluated] | None = None
        if self.memo_evaluations and self.device.type == "cpu":
            memo = self.__dict__.setdefault("_evaluated", {})
            if len(memo) > self.MEMO_ENTRIES:
                memo.clear()
            digests: dict[int, bytes] = {}  # per weights tensor of this call: hashed once
            for k, t in enumerate(tasks):
                if id(t.weights) not in digests:
                    digests[id(t.weights)] = content_digest(t.weights)
                keys[k] = key = (t.client, t.split, digests[id(t.weights)])
                out[k] = memo.get(key)
            self.evaluations_reused = getattr(self, "evaluations_reused", 0) + sum(r is not None for r in out)
            self.evaluations_asked = getattr(self, "evaluations_asked", 0) + len(tasks)
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for k, t in enumerate(tasks):
            if out[k] is None:
                groups[(id(t.weights), t.split)].append(k)
        for (_, split), idx in groups.items():
            data = self.data.train_data if split == "train" else self.data.test_data
            for k, r in zip(
                idx, evaluate_pooled(self.model, tasks[idx[0]].weights, [data(tasks[k].client) for k in idx])
            ):
                out[k] = r
                if memo is not None and (known := keys[k]) is not None:
                    memo[known] = r
        return out  # type: ignore[return-value]


def content_digest(t: torch.Tensor) -> bytes:
    """A digest of a CPU tensor's values (its dtype and shape included)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def reply_bytes(tasks: list[Task]) -> int:
    """Bytes of the models that the replies to ``tasks`` carry, which all live at once when the
    call returns: a training's model (the size of the model it starts from), a mixture round's K."""
    total = 0
    for t in tasks:
        if isinstance(t, Train):
            total += t.weights.numel() * t.weights.element_size()
        elif isinstance(t, MixtureTrain):
            total += sum(m.numel() * m.element_size() for m in t.models)
    return total


def check_reply_memory(tasks: list[Task], need: int | None = None, reusable: Callable[[], int] | None = None) -> None:
    """Refuse, in one line and before any work, a call whose replies (``need`` bytes; by default
    :func:`reply_bytes`) cannot fit in the memory free here plus ``reusable()`` (memory the
    caller keeps for them): the system would kill the process partway through the round (its
    checkpoint stays at the round before, but the user learns nothing of why)."""
    need = reply_bytes(tasks) if need is None else need
    if need <= 0:
        return
    free = available_bytes(at_least=need)
    if free is None or need <= free:
        return
    free += reusable() if reusable is not None else 0
    if need <= free:
        return
    n = sum(isinstance(t, (Train, MixtureTrain)) for t in tasks)
    raise UserError(
        f"this round's {n} client trainings return {need / 2**30:.1f} GiB of models "
        f"({need / max(n, 1) / 2**20:.1f} MiB each), more than the {free / 2**30:.1f} GiB of memory free "
        f"here; sample fewer clients a round (run.sample_rate), take factored replies on the low-rank "
        f"engine (run.factored_replies = true), or run it on a machine with more memory"
    )


__all__ = ["Executor", "check_reply_memory", "reply_bytes"]
