"""Drift: a federation whose clients' data change concept during the run.

A client starts on its true group's concept (rotated: its rotation; label_swap: its swap) and
may move to another group's concept at given rounds, keeping its own source samples: the same
images under the new concept's transformation, so its data sizes never change. The patterns are
the ones FedDrift (Jothimurugesan et al., AISTATS 2023) and FedCCFA (Chen et al., NeurIPS 2024,
``utils/drift.py`` of its official code) run:

``sudden``
    every drifting client moves at one round (FedCCFA: round 100 of 200);
``incremental``
    the drifting clients move in equal parts at several rounds (FedCCFA: 100, 110, 120);
``recurrent``
    the drifting clients move away and come back, alternately, at the rounds given (FedCCFA:
    away at 100, back at 150).

A drifting client moves to the next group's concept, (g + 1) mod G: a concept that other
clients hold at the same time, so a method that re-clusters can put it with them. Which
clients drift is drawn per true group with the run's seed (``share`` of each group's
participants).

The data of every (client, concept) pair a client visits beyond its first are extra *slots*
of the federation (:attr:`Drift.extra`); the engine runs a client's task on the slot of its
concept in the round (:mod:`stocfl.executors.drifting`), so that the algorithm and every
client store keep addressing the client by its own id.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stocfl.config import check_pattern
from stocfl.errors import UserError

if TYPE_CHECKING:
    from stocfl.data.federation import Federation


@dataclass(frozen=True, eq=False)
class Drift:
    """When each client's data change concept.

    ``start``: (N,) each client's concept at round 1 (its true group); ``changes``: (K, 3)
    int64 rows (round, client, concept), sorted by round, each a change from round ``round``
    on; ``pairs``: (S, 2) the (client, concept) pairs whose data are slot N + s of the
    federation the engine runs on; ``extra``: those slots' data (a Federation of S clients)."""

    start: np.ndarray
    changes: np.ndarray
    pairs: np.ndarray
    extra: Federation
    pattern: str = ""

    @functools.cached_property
    def _slot(self) -> dict[tuple[int, int], int]:
        n = len(self.start)
        return {(int(i), int(k)): n + s for s, (i, k) in enumerate(self.pairs)}

    @functools.cached_property
    def cohorts(self) -> dict[str, list[int]]:
        """The clients that change concept at each drift round (key ``"<round>"``) and those
        that never do (``"steady"``)."""
        out: dict[str, set[int]] = {}
        for r, i, _ in self.changes:
            out.setdefault(str(int(r)), set()).add(int(i))
        moving = {int(i) for i in self.changes[:, 1]}
        cohorts = {r: sorted(c) for r, c in out.items()}
        cohorts["steady"] = [i for i in range(len(self.start)) if i not in moving]
        return cohorts

    @property
    def rounds(self) -> list[int]:
        """The rounds at which some client changes concept."""
        return sorted({int(r) for r in self.changes[:, 0]})

    def concepts(self, t: int) -> np.ndarray:
        """Every client's concept in round ``t`` (the latest change at or before it)."""
        out = self.start.copy()
        for r, i, k in self.changes:
            if r > t:
                break
            out[i] = k
        return out

    def slots(self, t: int) -> np.ndarray:
        """The slot of the federation the engine runs on that holds each client's data in round ``t``."""
        c = self.concepts(t)
        out = np.arange(len(c), dtype=np.int64)
        for i in np.flatnonzero(c != self.start):
            out[i] = self._slot[(int(i), int(c[i]))]
        return out

    def changing(self, t: int, among: list[int]) -> list[int]:
        """The clients of ``among`` whose concept in round ``t`` differs from round ``t - 1``'s."""
        if t <= 1:
            return []
        before, now = self.concepts(t - 1), self.concepts(t)
        ids = np.asarray(among, dtype=np.int64)
        return ids[before[ids] != now[ids]].tolist()

    def digest_bytes(self) -> bytes:
        h = hashlib.sha256(np.concatenate([self.start, self.changes.ravel(), self.pairs.ravel()]).tobytes())
        h.update(self.extra.digest().encode())
        return h.digest()

    @staticmethod
    def plan(
        pattern: str, rounds: list[int], share: float, groups: np.ndarray, participants: list[int], seed: int
    ) -> np.ndarray:
        """The changes of ``pattern`` (rows (round, client, concept)): ``share`` of each true
        group's participants, drawn with the seed, move to the next group's concept at
        ``rounds`` (sudden: one round; incremental: in equal parts, one per round; recurrent:
        all of them, away and back alternately)."""
        check_pattern(pattern, rounds, share, "scenario")
        n_groups = int(groups.max()) + 1
        if n_groups < 2:
            raise UserError(
                "config: scenario.drift: the scenario has one group, so there is no other concept to drift to; "
                "use a scenario with groups (rotated, label_swap, ...)"
            )
        rng = np.random.default_rng([seed, 4])
        parts: list[list[int]] = [[] for _ in rounds]
        pool = np.asarray(participants, dtype=np.int64)
        for g in range(n_groups):
            members = pool[groups[pool] == g]
            movers = np.sort(members[rng.permutation(len(members))[: int(round(share * len(members)))]])
            if pattern == "incremental":
                for k, part in enumerate(np.array_split(movers, len(rounds))):
                    parts[k] += part.tolist()
            else:
                for part in parts:
                    part += movers.tolist()
        rows = []
        for k, (r, movers) in enumerate(zip(rounds, parts)):
            back = pattern == "recurrent" and k % 2 == 1
            rows += [(r, i, int(groups[i]) if back else (int(groups[i]) + 1) % n_groups) for i in movers]
        return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
