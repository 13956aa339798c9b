"""Per-client vectors (Ditto's personal models, FeSEM's local models) off the hot path.

A float32 array of shape (N, P) in a memory-mapped file of the run directory (in memory when
there is none); only the rows of the round's sampled clients are read or written, so a 4,800
client run with the 1.6M-parameter MLP keeps 31 GB on disk, not in RAM.

Exact resume: before rows are overwritten, their old values go to an undo file (written
atomically) tagged with the store's next version; the checkpoint records the version it saw.
Reopening at an older version puts the old rows back, so a kill between the store write and
the checkpoint leaves nothing half-applied. The checkpoint also holds a CRC-32 of every row
written: on reopening, a file of the wrong size, a missing file or a row that does not match
is an error, never a silently zeroed or altered model.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import shutil
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stocfl.errors import UserError
from stocfl.storage import checkpoint
from stocfl.storage.files import open_nofollow

# 2: the state declares its format, and every row set has its CRC (format 1 stores, written
# before row checksums, may have none)
FORMAT = 2

_READ_ONLY = contextvars.ContextVar("stocfl_store_read_only", default=False)


@contextlib.contextmanager
def read_only() -> Iterator[None]:
    """Stores opened inside read their files and never write them: the map is copy-on-write
    (rows put back to a checkpoint's version, or written, change this process's view only), no
    undo file is written, a missing file is not created. What export, assign and a loaded run
    use: reading a run changes nothing on its disk."""
    token = _READ_ONLY.set(True)
    try:
        yield
    finally:
        _READ_ONLY.reset(token)


class ClientStore:
    def __init__(self, n_clients: int, n_params: int, directory: Path | None = None, name: str = "clients"):
        self.n, self.p = n_clients, n_params
        self.has = np.zeros(n_clients, dtype=bool)
        self.crc = np.zeros(n_clients, dtype=np.int64)
        self.version = 0
        self.existed = False
        self.trusted = False  # rows this process wrote or verified
        self.read_only = _READ_ONLY.get()  # see read_only(): nothing written to disk
        self.path = None if directory is None else Path(directory) / f"{name}.f32"
        self.undo_path = None if directory is None else Path(directory) / f"{name}.undo.safetensors"
        if self.path is None or (self.read_only and not self.path.exists()):
            self.rows: np.ndarray = np.zeros((n_clients, n_params), dtype=np.float32)
        elif self.read_only:
            self.existed = True
            size = n_clients * n_params * 4
            os.close(open_nofollow(self.path, os.O_RDONLY))  # a link is refused, not followed
            if self.path.stat().st_size != size:
                raise UserError(
                    f"{self.path} holds {self.path.stat().st_size} bytes, expected {size} ({n_clients} "
                    f"clients x {n_params} parameters x 4); the store is damaged"
                )
            self.rows = np.memmap(self.path, dtype=np.float32, mode="c", shape=(n_clients, n_params))
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.existed = self.path.exists()
            size = n_clients * n_params * 4
            if self.path.is_symlink():  # a link to a store elsewhere: never mapped and rewritten
                open_nofollow(self.path, os.O_RDWR)
            if self.existed and self.path.stat().st_size != size:
                raise UserError(
                    f"{self.path} holds {self.path.stat().st_size} bytes, expected {size} ({n_clients} "
                    f"clients x {n_params} parameters x 4); the store is damaged, the run cannot resume"
                )
            self._reserve(size)  # opens it without following a link: the map below is of this file
            self.rows = np.memmap(self.path, dtype=np.float32, mode="r+", shape=(n_clients, n_params))

    def _reserve(self, size: int) -> None:
        """Give the file all its disk blocks now. A write through the memory map into a sparse
        file on a full disk kills the process (SIGBUS) with no message and mid-round; a
        reservation that fails is one line before the first round."""
        fd = open_nofollow(self.path, os.O_RDWR | (0 if self.existed else os.O_CREAT | os.O_TRUNC))
        with open(fd, "r+b") as f:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(f.fileno(), 0, size)
                    return
                raise OSError(errno.EOPNOTSUPP, "no posix_fallocate")
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    problem = err.strerror or str(err)
                else:  # a file system (or OS) that cannot reserve: check the free space instead
                    needed = size - getattr(os.fstat(f.fileno()), "st_blocks", 0) * 512
                    free = shutil.disk_usage(self.path.parent).free
                    if free >= needed:
                        f.truncate(size)
                        return
                    problem = f"{_size(free)} free, {_size(needed)} more needed"
        if not self.existed:
            self.path.unlink(missing_ok=True)
        raise UserError(
            f"{self.path}: cannot reserve {_size(size)} for {self.n} clients x {self.p} "
            f"parameters x 4 bytes ({problem}); free disk space, give the run a directory on a larger "
            f"disk, or run fewer clients or a smaller model"
        )

    def __contains__(self, client: int) -> bool:
        return bool(self.has[client])

    def get(self, client: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.rows[client]))

    def write(self, rows: dict[int, torch.Tensor]) -> None:
        ids = sorted(rows)
        if (
            self.undo_path is not None and not self.read_only
        ):  # only rows that held a model need undoing: the others are unset at the checkpoint
            had = [i for i in ids if self.has[i]]
            checkpoint.save_rows(
                self.undo_path,
                "rows",
                (self.rows[i] for i in had),
                len(had),
                self.p,
                {"version": self.version + 1, "ids": had},
            )
        for i in ids:
            row = rows[i].numpy()
            self.rows[i] = row
            self.has[i] = True
            self.crc[i] = _crc(row)
        self.trusted = True
        if isinstance(self.rows, np.memmap) and not self.read_only:
            self.rows.flush()
        self.version += 1

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The checkpoint's part: the version and which rows are set; the rows themselves only
        when the store lives in memory (on disk they stay in the store's file)."""
        has = np.flatnonzero(self.has).tolist()
        tensors = {"rows": torch.from_numpy(self.rows[has].copy())} if self.path is None and has else {}
        if has:
            tensors["crc"] = torch.from_numpy(self.crc[has].copy())
        return tensors, {"version": self.version, "has": has, "format": FORMAT}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Back to the checkpoint's version (undoing a write the checkpoint did not see)."""
        if "rows" in tensors:
            self.rows[meta["has"]] = tensors["rows"].numpy()
        if self.undo_path is not None and self.undo_path.exists():
            old, undo = checkpoint.load(self.undo_path)
            if undo["version"] > meta["version"]:
                for k, i in enumerate(undo["ids"]):
                    self.rows[i] = old["rows"][k].numpy()
                if isinstance(self.rows, np.memmap) and not self.read_only:
                    self.rows.flush()
        self.version = meta["version"]
        self.has[:] = False
        self.has[meta["has"]] = True
        self.crc[:] = 0
        if meta.get("format", 1) >= FORMAT and meta["has"] and "crc" not in tensors:
            raise UserError(
                f"{self.path or 'the in-memory store'}: the checkpoint has {len(meta['has'])} client models and "
                f"no checksums for them (edited); the run cannot resume"
            )
        if "crc" in tensors:  # checkpoints of format 1 from before row checksums have none
            self.crc[meta["has"]] = tensors["crc"].numpy()
            if not self.trusted:  # a run reopened from disk; in-process restores need no check
                self.verify(meta["has"])
        self.trusted = True

    def verify(self, ids: list[int]) -> None:
        if self.path is not None and ids and not self.existed:  # (read-only: a missing file is not created)
            raise UserError(
                f"{self.path} is missing; the checkpoint has {len(ids)} client models in it, the run cannot resume"
            )
        for i in ids:
            if _crc(self.rows[i]) != self.crc[i]:
                where = self.path or "the in-memory store"
                raise UserError(
                    f"{where}: the model of client {i} does not match the checkpoint (corrupt store); "
                    f"the run cannot resume"
                )


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _crc(row: np.ndarray) -> int:
    """CRC-32 of one row's float32 bytes."""
    return zlib.crc32(memoryview(np.ascontiguousarray(row, dtype=np.float32)).cast("B"))
