"""The text formats of a results directory: JSON lines, JSON, TOML, CSV (all written atomically)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stocfl.storage.files import write_atomic


def json_line(row: dict[str, Any]) -> str:
    """One metrics row as written (and as the checkpoint's hash chain reads it)."""
    return json.dumps(row, sort_keys=True)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json_line(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a kill: everything after it is redone
    return rows


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, "".join(json_line(r) + "\n" for r in rows))


def to_toml(cfg: dict[str, dict[str, Any]]) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)

    return "\n".join(
        f"[{section}]\n" + "".join(f"{k} = {value(v)}\n" for k, v in keys.items()) for section, keys in cfg.items()
    )


CSV_DECIMALS = 6  # every float in every CSV file: one precision, enough for accuracies on 10^5 samples


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    import csv
    import io

    buf = io.StringIO(newline="")
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: round(v, CSV_DECIMALS) if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    write_atomic(path, buf.getvalue())
