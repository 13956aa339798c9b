"""Who is present when: a federation whose clients join a running training and leave it.

Client i takes part in rounds ``joins[i] <= t < leaves[i]`` (``leaves[i] = 0``: it never
leaves). Round 1's clients are there from the start; a client that joins at round t > 1 is an
*arrival* of that round: the runner hands it to the algorithm before the round
(:meth:`stocfl.algorithms.Algorithm.arrive`), samples only among the clients present, and
scores every round over them. One interval per client: a client that left does not come back.
Held-out clients (``scenario.holdout``) are never part of a schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stocfl.errors import UserError


@dataclass(frozen=True, eq=False)
class Schedule:
    """Each client's first round (``joins``, 1 = from the start) and the first round it is gone
    (``leaves``, 0 = never), both (N,) int64."""

    joins: np.ndarray
    leaves: np.ndarray

    def present(self, t: int, among: list[int]) -> list[int]:
        """The clients of ``among`` that take part in round ``t``."""
        ids = np.asarray(among, dtype=np.int64)
        j, lv = self.joins[ids], self.leaves[ids]
        return ids[(j <= t) & ((lv == 0) | (t < lv))].tolist()

    def joining(self, t: int, among: list[int]) -> list[int]:
        """The clients of ``among`` that arrive at round ``t`` (none at round 1: they start)."""
        if t <= 1:
            return []
        ids = np.asarray(among, dtype=np.int64)
        return ids[self.joins[ids] == t].tolist()

    def leaving(self, t: int, among: list[int]) -> list[int]:
        """The clients of ``among`` whose last round was ``t - 1``."""
        ids = np.asarray(among, dtype=np.int64)
        return ids[self.leaves[ids] == t].tolist()

    @property
    def last_change(self) -> int:
        """The last round at which someone joins or leaves (1: nobody ever does)."""
        return int(max(self.joins.max(initial=1), self.leaves.max(initial=1)))

    def digest_bytes(self) -> bytes:
        return np.concatenate([self.joins, self.leaves]).astype(np.int64).tobytes()

    @classmethod
    def checked(cls, joins, leaves, participants: list[int], n_clients: int, where: str = "schedule") -> Schedule:
        """A schedule from each client's join round and leave round (0 = never), refused in one
        :class:`UserError` line unless every round is a whole number >= 1 (leaves: 0 or later
        than the join) and some client is present in every round up to the last change."""
        arrays = []
        for what, v, low in (("joins", joins, 1), ("leaves", leaves, 0)):
            if v is None:
                v = np.ones(n_clients, dtype=np.int64) if what == "joins" else np.zeros(n_clients, dtype=np.int64)
            a = np.asarray(v)
            if a.shape != (n_clients,) or not (np.issubdtype(a.dtype, np.integer) and not a.dtype == bool):
                raise UserError(f"{where}: {what} must be {n_clients} whole numbers, one round per client")
            if (a < low).any():
                i = int(np.flatnonzero(a < low)[0])
                raise UserError(
                    f"{where}: client {i} {what[:-1]}s at round {int(a[i])}; rounds count from 1"
                    + (" (0: never leaves)" if what == "leaves" else "")
                )
            arrays.append(a.astype(np.int64))
        j, lv = arrays
        bad = np.flatnonzero((lv > 0) & (lv <= j))
        if len(bad):
            i = int(bad[0])
            raise UserError(
                f"{where}: client {i} leaves at round {int(lv[i])}, not after it joins (round {int(j[i])}); "
                f"a client leaves after its first round"
            )
        s = cls(j, lv)
        empty = next((t for t in range(1, s.last_change + 1) if not s.present(t, participants)), None)
        if empty is not None:
            raise UserError(f"{where}: no client is present at round {empty}; every round needs one")
        return s

    @classmethod
    def from_shares(
        cls,
        participants: list[int],
        n_clients: int,
        present_at_start: float,
        join_rounds: list[int],
        leave: float,
        leave_rounds: list[int],
        seed: int,
    ) -> Schedule | None:
        """The config's schedule: ``present_at_start`` of the participants, drawn at random (the
        run's seed), are there from round 1; the rest join in equal parts at ``join_rounds``;
        ``leave`` of the clients present at the start leave in equal parts at ``leave_rounds``.
        None when everyone is there throughout."""
        if present_at_start >= 1 and leave <= 0:
            return None
        rng = np.random.default_rng([seed, 3])
        order = np.asarray(participants, dtype=np.int64)[rng.permutation(len(participants))]
        n_start = max(1, round(present_at_start * len(order)))
        joins = np.ones(n_clients, dtype=np.int64)
        for t, part in zip(join_rounds, np.array_split(order[n_start:], len(join_rounds) or 1)):
            joins[part] = t
        leaves = np.zeros(n_clients, dtype=np.int64)
        starters = order[:n_start]
        gone = starters[rng.permutation(len(starters))[: int(leave * len(starters))]]
        for t, part in zip(leave_rounds, np.array_split(gone, len(leave_rounds) or 1)):
            leaves[part] = t
        return cls.checked(joins, leaves, participants, n_clients, "config: [scenario] schedule")
