"""The text formats of a results directory: JSON lines, JSON, TOML, CSV (all written atomically)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from stocfl.storage.files import open_nofollow, write_atomic


def json_line(row: dict[str, Any]) -> str:
    """One metrics row as written (and as the checkpoint's hash chain reads it)."""
    return json.dumps(row, sort_keys=True)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with open(fd, "a", encoding="utf-8") as f:
        f.write(json_line(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file up to the first that is not a whole JSON object on a line
    of its own in UTF-8 (a line cut short by a kill or a full disk, NUL bytes, any other tail):
    everything from there on is redone."""
    if not path.exists():
        return []
    rows = []
    data = path.read_bytes()
    lines = data.split(b"\n")
    for k, line in enumerate(lines):
        if k == len(lines) - 1:
            break  # after the last newline: empty, or a row whose newline was never written
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
    return rows


def jsonl_bytes(rows: list[dict[str, Any]]) -> bytes:
    """The file :func:`write_jsonl` writes for ``rows``."""
    return "".join(json_line(r) + "\n" for r in rows).encode("utf-8")


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_atomic(path, jsonl_bytes(rows))


def toml_string(v: str) -> str:
    """``v`` as a TOML basic string that reads back as ``v``: any character outside the ASCII
    controls as itself (a non-BMP one too: JSON's surrogate-pair escapes are not TOML), the
    controls and DEL escaped; a string holding a lone surrogate (a path with bytes that are not
    UTF-8) cannot be written and is one line."""
    if any("\ud800" <= ch <= "\udfff" for ch in v):
        from stocfl.errors import UserError

        raise UserError(f"{v!r:.120} holds bytes that are not UTF-8 text; rename it (a config file is UTF-8)")
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")


def to_toml(cfg: dict[str, dict[str, Any]]) -> str:
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return toml_string(v)
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
