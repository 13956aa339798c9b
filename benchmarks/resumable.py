"""What the resumable benchmark scripts share: their results file, read at the start and written
after every measurement, so that a script stopped anywhere skips what it has already measured."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def resumable(path: str | Path, echo: bool = False) -> tuple[dict[str, Any], Callable[[str, Any], None]]:
    """(the results written so far, ``save(key, row)``: record one more and write the file; with
    ``echo``, print it as one JSON line too)."""
    out = Path(path)
    done: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}

    def save(key: str, row: Any) -> None:
        done[key] = row
        out.write_text(json.dumps(done, indent=1) + "\n")
        if echo:
            print(json.dumps({key: row}), flush=True)

    return done, save
