"""A drifting federation's engine side: each client's task runs on the data it holds in the round.

With drift (:mod:`stocfl.data.drift`) the engine is built on
:meth:`~stocfl.data.federation.Federation.engine_federation`, where client i's data under a
concept it moves to is another slot. :class:`Drifting` wraps the engine's ``execute``: a task
for client i goes to the slot of i's concept in the current round, and a failure reported for
a slot is reported for client i. Above it, the algorithm, the result checks and every
per-client store (local BatchNorm included) see client i only, as a real client's server would:
the client's data changed, not who it is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from stocfl.client.tasks import ClientsDropped
from stocfl.data.drift import Drift


class Drifting:
    """``execute`` with every task sent to its client's slot in round :attr:`t` (:meth:`at`)."""

    def __init__(self, execute: Callable[[list[Any]], list[Any]], drift: Drift, t: int):
        self.inner, self.drift = execute, drift
        self.t: int | None = None
        self.at(t)

    def at(self, t: int) -> None:
        """Run the tasks that follow on the data of round ``t``."""
        if t != self.t:
            self.t = t
            self.slots: np.ndarray = self.drift.slots(t)

    def __call__(self, tasks: list[Any]) -> list[Any]:
        client_of: dict[int, int] = {}
        sent = []
        for task in tasks:
            s = int(self.slots[task.client])
            if s != task.client:
                client_of[s] = task.client
                task = dataclasses.replace(task, client=s)
            sent.append(task)
        try:
            return self.inner(sent)
        except ClientsDropped as err:
            if not client_of:
                raise

            def named(reason: str) -> str:
                return re.sub(r"^client (\d+)", lambda m: f"client {client_of.get(int(m[1]), int(m[1]))}", reason)

            raise ClientsDropped([client_of.get(c, c) for c in err.clients], [named(r) for r in err.reasons]) from None
