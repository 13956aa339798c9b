"""Writing files so that a kill at any moment leaves the old version or the new one, never a
mix: write a temporary file beside the target, fsync it, rename it over the target, fsync the
directory."""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path


def write_atomic(path: Path, data: bytes | str) -> None:
    path = Path(path)
    # a name of its own: two processes writing one file (two reproductions of one table's rows)
    # must not rename each other's half-written copy
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot sync a directory
    finally:
        os.close(fd)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=Path(path).suffix.lstrip(".") or "png")
    write_atomic(path, buf.getvalue())
