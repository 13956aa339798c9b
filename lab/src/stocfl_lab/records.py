"""The lab's record files checked field by field as they are read: a reproduction table's
``TABLE.json`` (here) and the benchmark's record (its fields in :mod:`stocfl_lab.benchmark`,
checked by :func:`problem`).

`reproduce` reuses the runs a table records and `--coverage` prints its rows' figures, both
without further checks: a file that cannot be read, or a run or row with a field missing or of
the wrong kind (edited by hand, damaged, or written by another tool), is refused here in one
line naming the file, the row and the field. Read as nothing, its runs would be run again and
the file written over."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from stocfl.errors import UserError

FIX = "restore it from git, or remove it to run the table again"


def number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))


def number(v: Any) -> bool:
    return v is not None and number_or_none(v)


def int_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _str_or_none(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _curves_ok(v: Any) -> bool:
    """None, or per measure [rounds, values] of one length, numbers."""
    if v is None:
        return True
    if not isinstance(v, dict):
        return False
    for series in v.values():
        if not (isinstance(series, list) and len(series) == 2 and all(isinstance(s, list) for s in series)):
            return False
        rounds, values = series
        if len(rounds) != len(values) or not all(number(x) for x in rounds + values):
            return False
    return True


def _ours_ok(v: Any) -> bool:
    """A row's summary over its runs: null, or n (an integer) and mean, std, ci95 (numbers or null)."""
    if v is None:
        return True
    return (
        isinstance(v, dict)
        and int_or_none(v.get("n"))
        and all(number_or_none(v.get(k)) for k in ("mean", "std", "ci95"))
    )


Check = tuple[bool, Callable[[Any], bool], str]  # required, the test, what the value must be

# a recorded run's (or a run's progress's) fields
RUN_FIELDS: dict[str, Check] = {
    "seed": (True, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "digest": (True, lambda v: isinstance(v, str) and len(v) == 64, "a config digest (64 hex digits)"),
    **{
        k: (False, number_or_none, "a number or null")
        for k in (
            "accuracy",
            "global_accuracy",
            "macro_accuracy",
            "heldout_accuracy",
            "ari",
            "authors_metric",
            "clients_at_target",
        )
    },
    "seconds": (False, lambda v: number(v) and v >= 0, "a number of seconds"),
    **{
        k: (False, int_or_none, "an integer or null")
        for k in ("n_clusters", "threads", "rounds", "rounds_done", "measured_at")
    },
    **{k: (False, _str_or_none, "a string or null") for k in ("processor", "torch", "date", "authors")},
    "curves": (False, _curves_ok, "null or, per measure, [rounds, values] of one length"),
}

# a row's summary fields, which the coverage page prints
ROW_FIELDS: dict[str, Check] = {
    "status": (False, lambda v: isinstance(v, str), "a string"),
    "ours": (False, _ours_ok, "null or a summary of n, mean, std and ci95"),
    "authors_metric": (False, _ours_ok, "null or a summary of n, mean, std and ci95"),
    "difference": (False, number_or_none, "a number or null"),
}


def problem(fields: dict[str, Check], rec: dict[str, Any], where: str = "") -> str | None:
    """The first of ``fields`` that ``rec`` lacks (where required) or holds of the wrong kind,
    said as "has no NAME" or "has NAME = VALUE, where it must be ..." (``where``: "has WHERE
    without NAME", "has WHERE with NAME = ..."); None when every field passes."""
    for name, (required, ok, what) in fields.items():
        if name not in rec:
            if required:
                return f"has {where} without {name!r}" if where else f"has no {name!r}"
        elif not ok(rec[name]):
            value = json.dumps(rec[name])[:60]
            return f"has {f'{where} with ' if where else ''}{name} = {value}, where it must be {what}"
    return None


def entry_problem(entry: dict[str, Any]) -> str | None:
    """What is wrong with one row of a table's record (None: nothing)."""
    said = problem(ROW_FIELDS, entry, "a summary")
    if said:
        return said
    for field in ("runs", "other_runs", "progress"):
        recs = entry.get(field)
        if recs is None:
            continue
        if not isinstance(recs, list):
            return f"has {field} = {json.dumps(recs)[:60]}, where it must be a list of runs"
        for rec in recs:
            if not isinstance(rec, dict):
                return f"has a run in {field} that is not a table of fields ({json.dumps(rec)[:60]})"
            said = problem(RUN_FIELDS, rec, f"a run in {field} (seed {rec.get('seed')})")
            if said:
                return said
    return None


def load_json(path: Path, fix: str) -> Any:
    """The JSON in ``path`` (None where there is no file); a file that cannot be read or parsed
    is one line saying so and ``fix``, what to do about it."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is unreadable ({err}); {fix}") from None


def read_table_record(path: Path) -> dict[str, Any] | None:
    """The table's record at ``path``, every row checked; None where there is no file."""
    doc = load_json(path, FIX)
    if doc is None:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise UserError(f"{path} is not a reproduction table (no list of 'rows'); {FIX}")
    for i, entry in enumerate(doc["rows"], 1):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise UserError(f"{path}: row {i} is not a table of fields with a name; {FIX}")
        said = entry_problem(entry)
        if said:
            raise UserError(f"{path}: row {entry['name']!r} {said}; {FIX}")
    return doc
