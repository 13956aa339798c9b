"""The federation: every client's train and test data, stacked, with true groups where known."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from stocfl.bounds import MAX_CLASSES
from stocfl.data.drift import Drift
from stocfl.data.schedule import Schedule
from stocfl.errors import UserError


def gather(x: torch.Tensor, y: torch.Tensor, parts: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """The samples of each client's index array in ``parts``, stacked client after client, and
    the clients' offsets into them."""
    idx = torch.from_numpy(np.concatenate(parts).astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])])
    return x[idx].contiguous(), y[idx], offsets


@dataclass(repr=False)
class Federation:
    """Every client's train and test data, stacked: client i's train set is
    ``x_train[train_offsets[i]:train_offsets[i+1]]`` (views, no copies)."""

    scenario: str
    dataset: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    train_offsets: np.ndarray
    x_test: torch.Tensor
    y_test: torch.Tensor
    test_offsets: np.ndarray
    n_classes: int
    groups: np.ndarray | None = None  # true group of each client, where the scenario has one
    notes: list[str] = field(default_factory=list)
    heldout: np.ndarray | None = None  # clients kept out of training (new clients at the end)
    mixtures: np.ndarray | None = None  # each client's true shares of the groups (N x G), where it mixes them
    schedule: Schedule | None = None  # who is present when (None: every participant, every round)
    drift: Drift | None = None  # which concept each client's data follow when (None: one, throughout)

    def __repr__(self) -> str:
        groups = "no true groups" if self.groups is None else f"{len(np.unique(self.groups))} true groups"
        held = f", {int(self.heldout.sum())} held out" if self.heldout is not None and self.heldout.any() else ""
        if self.schedule is not None:
            held += f", present from rounds {int(self.schedule.joins[self.participants].min())}.."
            held += f"{self.schedule.last_change}"
        if self.drift is not None:
            held += f", {self.drift.pattern} drift at rounds {', '.join(map(str, self.drift.rounds))}"
        return (
            f"Federation({self.scenario} on {self.dataset}: {self.n_clients} clients{held}, "
            f"{len(self.y_train)} train / {len(self.y_test)} test samples of shape {self.input_shape}, "
            f"{self.n_classes} classes, {groups})"
        )

    @property
    def participants(self) -> list[int]:
        if self.heldout is None:
            return list(range(self.n_clients))
        return np.flatnonzero(~self.heldout).tolist()

    def present(self, t: int) -> list[int]:
        """The participants that take part in round ``t`` (all of them without a schedule)."""
        return self.participants if self.schedule is None else self.schedule.present(t, self.participants)

    def with_schedule(self, joins=None, leaves=None) -> Federation:
        """This federation with clients that join a running training and leave it: client i
        takes part in rounds ``joins[i] <= t < leaves[i]`` (``joins``: N rounds >= 1, default all
        1; ``leaves``: N rounds, 0 = never, default all 0). Held-out clients stay out whatever
        their rounds. Refused in one line unless every round has a client
        (:meth:`~stocfl.data.schedule.Schedule.checked`)."""
        s = Schedule.checked(joins, leaves, self.participants, self.n_clients, "Federation.with_schedule")
        return replace(self, schedule=s, notes=list(self.notes))

    def with_validation(self, fraction: float, seed: int = 0) -> Federation:
        """This federation for tuning: each client holds out ``fraction`` of its train samples
        (round(fraction x n), at least 1 and at most n - 1, drawn with ``seed``) and they become
        its test data; the real test data are not used. So a setting is chosen on the clients'
        own training data, never on the test data it will be judged on. A client of one train
        sample (a Dirichlet split's smallest) keeps it for training and holds none out: it
        trains as in the run tuned for, and weighs nothing in the validation accuracy."""
        if not 0 < fraction < 1:
            raise UserError(f"config: scenario.validation = {fraction}: expected a fraction in (0, 1)")
        if self.drift is not None:
            raise UserError(
                "config: scenario.validation with scenario.drift: a drifting client's data are built from its "
                "samples as they are; tune on the scenario without drift"
            )
        rng = np.random.default_rng([int(seed), 3])
        train, held = [], []
        for i in range(self.n_clients):
            a, b = int(self.train_offsets[i]), int(self.train_offsets[i + 1])
            n = b - a
            v = min(n - 1, max(1, round(fraction * n))) if n > 1 else 0
            order = rng.permutation(n)
            held.append(np.sort(order[:v]) + a)
            train.append(np.sort(order[v:]) + a)

        x_tr, y_tr, off_tr = gather(self.x_train, self.y_train, train)
        x_va, y_va, off_va = gather(self.x_train, self.y_train, held)
        note = f"validation: {fraction:g} of each client's train samples held out as its test data (test data unused)"
        return replace(
            self,
            x_train=x_tr,
            y_train=y_tr,
            train_offsets=off_tr,
            x_test=x_va,
            y_test=y_va,
            test_offsets=off_va,
            notes=[*self.notes, note],
        )

    def groups_at(self, t: int) -> np.ndarray | None:
        """Each client's true group in round ``t``: the concept its data follow then (drift)."""
        return self.groups if self.drift is None or self.groups is None else self.drift.concepts(t)

    def engine_federation(self) -> Federation:
        """The data the engine runs tasks on: this federation, and with drift its slots of
        every client's data under the concepts it moves to (clients N.., see
        :mod:`stocfl.data.drift`)."""
        if self.drift is None:
            return self
        x = self.drift.extra

        def joined(a, b):
            return np.concatenate([a, b[1:] + a[-1]])

        return Federation(
            self.scenario,
            self.dataset,
            torch.cat([self.x_train, x.x_train]),
            torch.cat([self.y_train, x.y_train]),
            joined(self.train_offsets, x.train_offsets),
            torch.cat([self.x_test, x.x_test]),
            torch.cat([self.y_test, x.y_test]),
            joined(self.test_offsets, x.test_offsets),
            self.n_classes,
        )

    @property
    def heldout_clients(self) -> list[int]:
        return [] if self.heldout is None else np.flatnonzero(self.heldout).tolist()

    @property
    def n_clients(self) -> int:
        return len(self.train_offsets) - 1

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def train_sizes(self) -> np.ndarray:
        return np.diff(self.train_offsets)

    @property
    def test_sizes(self) -> np.ndarray:
        return np.diff(self.test_offsets)

    def label_distributions(self) -> np.ndarray:
        """Each client's train label histogram scaled to unit length, (n_clients, n_classes)
        float64: the rows' dot products are the cosines of the clients' label distributions (a
        client with no train data has a zero row)."""
        cell = np.repeat(np.arange(self.n_clients), self.train_sizes) * self.n_classes + self.y_train.cpu().numpy()
        counts = np.bincount(cell, minlength=self.n_clients * self.n_classes).reshape(self.n_clients, -1).astype(float)
        norms = np.linalg.norm(counts, axis=1, keepdims=True)
        return np.divide(counts, norms, out=np.zeros_like(counts), where=norms > 0)

    def digest(self) -> str:
        """sha256 of what the clients hold (inputs, labels, who holds which, the classes, the
        held-out clients, the schedule): a run started on a federation given in Python resumes only on the
        same one."""
        h = hashlib.sha256(f"{self.n_classes} {self.input_shape}".encode())
        for arr in (self.train_offsets, self.test_offsets, self.heldout):
            h.update(b"-" if arr is None else np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        if self.schedule is not None:  # a run without one keeps the digest it always had
            h.update(b"schedule" + self.schedule.digest_bytes())
        if self.drift is not None:
            h.update(b"drift" + self.drift.digest_bytes())
        for t in (self.y_train, self.y_test, self.x_train, self.x_test):
            for part in t.detach().cpu().reshape(len(t), -1).split(8192):  # a part at a time: no copy of it all
                h.update(part.contiguous().numpy().tobytes())
        return h.hexdigest()

    def train_data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.train_offsets[i], self.train_offsets[i + 1]
        return self.x_train[a:b], self.y_train[a:b]

    def test_data(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.test_offsets[i], self.test_offsets[i + 1]
        return self.x_test[a:b], self.y_test[a:b]

    @classmethod
    def from_arrays(
        cls, train, test, groups=None, n_classes: int | None = None, name: str = "arrays", holdout=None
    ) -> Federation:
        """A federation from each client's own data: ``train[i]`` and ``test[i]`` are client i's
        ``(x, y)`` (tensors or arrays: inputs (n, ...) of one shape for all, labels 0..classes-1).
        ``groups``: each client's true group, where known (for ARI/NMI); ``n_classes``: default
        the largest label + 1; ``holdout``: clients kept out of training (ids or a mask).
        Bad input is one :class:`~stocfl.errors.UserError` line naming the client."""
        from stocfl.data.datasets import check_arrays

        train, test = list(train), list(test)
        if not train or len(train) != len(test):
            raise UserError(
                f"Federation.from_arrays: {len(train)} train and {len(test)} test sets; give one of "
                f"each per client (at least one client)"
            )
        parts = []
        for split, sets in (("train", train), ("test", test)):
            for i, xy in enumerate(sets):
                if not isinstance(xy, (tuple, list)) or len(xy) != 2:
                    raise UserError(f"Federation.from_arrays: {split}[{i}] must be a pair (x, y)")
                parts.append((split, i, *check_arrays(f"client {i} {split}", *xy, allow_empty=split == "test")))
        shapes = {tuple(x.shape[1:]) for _, _, x, _ in parts if len(x)}
        if len(shapes) != 1:
            raise UserError(
                f"Federation.from_arrays: clients' inputs have different shapes {sorted(shapes)}; "
                f"every client's inputs must share one shape"
            )
        top = max(int(y.max()) for *_, y in parts if len(y)) + 1
        if n_classes is not None and (
            isinstance(n_classes, bool)
            or not isinstance(n_classes, (int, np.integer))
            or not 2 <= n_classes <= MAX_CLASSES
        ):
            raise UserError(
                f"Federation.from_arrays: n_classes = {n_classes!r}; expected an integer in 2..{MAX_CLASSES}, "
                f"or None for the largest label + 1"
            )
        if n_classes is None:  # a stray large label must not quietly become the class count
            present = len(torch.unique(torch.cat([y for *_, y in parts if len(y)])))
            if top > 2 and 2 * present < top:
                raise UserError(
                    f"Federation.from_arrays: labels run to {top - 1} but only {present} distinct labels appear; "
                    f"pass n_classes={top} to keep {top} classes, or number the labels 0..{present - 1}"
                )
        k = top if n_classes is None else int(n_classes)
        if top > k:
            bad = next((split, i) for split, i, _, y in parts if len(y) and int(y.max()) >= k)
            raise UserError(
                f"Federation.from_arrays: client {bad[1]} {bad[0]} has label {top - 1}, outside "
                f"0..{k - 1} (n_classes = {k})"
            )
        (shape,) = shapes

        def stack(split):
            xs = [x if len(x) else x.reshape(0, *shape) for sp, _, x, _ in parts if sp == split]
            ys = [y for sp, _, _, y in parts if sp == split]
            return torch.cat(xs), torch.cat(ys), np.concatenate([[0], np.cumsum([len(y) for y in ys])])

        (xtr, ytr, otr), (xte, yte, ote) = stack("train"), stack("test")
        n = len(train)
        if groups is not None:
            groups = np.asarray(groups)
            if groups.shape != (n,) or not np.issubdtype(groups.dtype, np.integer) or (groups < 0).any():
                raise UserError(f"Federation.from_arrays: groups must be {n} integers >= 0, one per client")
            groups = groups.astype(np.int64)
        fed = cls("custom", name, xtr, ytr, otr, xte, yte, ote, k, groups)
        if holdout is not None:
            mask = np.zeros(n, dtype=bool)
            try:
                h = np.asarray(holdout)
                if h.size and h.dtype != bool and (not np.issubdtype(h.dtype, np.integer) or (h < 0).any()):
                    raise ValueError("not client ids")  # a negative id would count from the end
                mask[h if h.dtype == bool else list(h)] = True
            except (IndexError, ValueError, TypeError):
                raise UserError(
                    f"Federation.from_arrays: holdout must be client ids in 0..{n - 1} or a mask of {n}"
                ) from None
            if mask.all():
                raise UserError("Federation.from_arrays: holdout leaves no client to train")
            fed.heldout = mask if mask.any() else None
        return fed

    @classmethod
    def from_datasets(
        cls, train, test, groups=None, n_classes: int | None = None, name: str = "datasets", holdout=None
    ) -> Federation:
        """:meth:`from_arrays` from one ``torch.utils.data.Dataset`` per client and split, each
        item an ``(x, y)`` pair."""

        def arrays(ds, what):
            try:
                items = [ds[j] for j in range(len(ds))]
            except Exception as err:  # a user's Dataset can raise anything
                raise UserError(f"Federation.from_datasets: {what}: cannot read its items ({err})") from None
            if not items:
                return torch.zeros(0, 1), torch.zeros(0, dtype=torch.long)
            if (
                j := next((j for j, it in enumerate(items) if not isinstance(it, (tuple, list)) or len(it) != 2), None)
            ) is not None:
                raise UserError(f"Federation.from_datasets: {what}: item {j} is not a pair (x, y)")
            try:
                xs = [torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x) for x, _ in items]
                ys = [torch.as_tensor(np.asarray(y) if not isinstance(y, torch.Tensor) else y) for _, y in items]
            except (TypeError, ValueError) as err:
                raise UserError(f"Federation.from_datasets: {what}: not arrays of numbers ({err})") from None
            if len({tuple(x.shape) for x in xs}) != 1:
                raise UserError(f"Federation.from_datasets: {what}: items of different shapes")
            if (j := next((j for j, y in enumerate(ys) if y.numel() != 1), None)) is not None:
                raise UserError(
                    f"Federation.from_datasets: {what}: item {j}'s label has shape {tuple(ys[j].shape)}; "
                    f"expected one number"
                )
            # stacked as given, so that from_arrays refuses a label such as 1.7 instead of truncating it
            return torch.stack(xs), torch.stack([y.reshape(()) for y in ys])

        train = [arrays(d, f"client {i} train") for i, d in enumerate(train)]
        test = [arrays(d, f"client {i} test") for i, d in enumerate(test)]
        return cls.from_arrays(train, test, groups, n_classes, name, holdout)
