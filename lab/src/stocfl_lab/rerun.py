"""What the lab says when a recorded run, run again under the same config, gives other numbers.

Runs repeat to the bit only on the same kind of processor at the same torch threads (kernels for
another instruction set or thread count round otherwise, and training amplifies it): the
benchmark and the reproductions both record the two with every run, and both name them when a
re-run's numbers differ, so a reader can tell a machine's rounding from a change of code.
"""

from __future__ import annotations

import math
from typing import Any


def where_run(held: dict[str, Any], now: dict[str, Any]) -> str:
    """Whether the machine explains a re-run's other numbers (``held``: the record's run,
    ``now``: the re-run; each with ``processor`` and ``threads``)."""
    was = (held.get("processor"), held.get("threads"))
    here = (now.get("processor"), now.get("threads"))
    if was[0] is None:
        return (
            f"recorded without its processor (run again on {here[0]}, {here[1]} torch threads): the machine may "
            f"explain it"
        )
    if was != here:
        return (
            f"recorded on {was[0]} at {was[1]} torch threads, run again on {here[0]} at {here[1]}: another "
            f"processor or thread count rounds otherwise"
        )
    return f"on the same processor ({here[0]}) and torch threads ({here[1]}): not the machine, the code changed"


def moved(held: dict[str, Any], now: dict[str, Any], keys) -> list[str]:
    """``key old -> new`` for each of ``keys`` whose value the re-run did not give again."""
    return [f"{k} {held.get(k)} -> {now.get(k)}" for k in keys if held.get(k) != now.get(k)]


def recorded_places(x: float) -> int:
    """The decimals a rounded figure holds: the fewest at which it is itself, its float's last
    bits aside (a percentage rounded to 87.07 and divided by 100 reads 0.8706999999999999, a
    figure of 4 decimals, not 16)."""
    for places in range(18):
        if abs(round(x, places) - x) <= 2 * math.ulp(x):
            return places
    return 17


def moved_as_recorded(held: dict[str, Any], now: dict[str, Any], keys) -> list[str]:
    """:func:`moved` for a record migrated from an older table, whose numbers were rounded when
    written (an accuracy of 0.794) and which lacks the figures added since (None): each figure
    it holds compared at the decimals it holds, the others not at all."""
    said = []
    for k in keys:
        was, new = held.get(k), now.get(k)
        if was is None:
            continue
        if isinstance(was, float) and isinstance(new, (int, float)):
            places = recorded_places(was)
            if round(float(new), places) != round(was, places):
                said.append(
                    f"{k} {round(was, places)} -> {new} (compared at the {places} decimals it was recorded with)"
                )
        elif was != new:
            said.append(f"{k} {was} -> {new}")
    return said
