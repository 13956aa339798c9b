"""Per-client vectors (Ditto's personal models, FeSEM's local models) off the hot path.

A float32 array of shape (N, P). Where it fits the run's budget (``run.store_ram``) it lives in
memory, and what a resume needs goes to disk as a journal: each write appends the rows it set
(one record, no copy of the rows it replaced), and once the journal holds twice the store it is
folded into a snapshot of the rows as of the last checkpoint. Beyond the budget it lives in a
memory-mapped file of the run directory and only the rows of the round's sampled clients are
read or written, so a 4,800 client run with the 1.6M-parameter MLP keeps 31 GB on disk, not in
RAM. Without a run directory it lives in memory and the checkpoint holds its rows.

Exact resume. On disk: before rows are overwritten, the values the last checkpoint has for
them go to an undo file (written atomically, kept across every write until the next
checkpoint) tagged with the checkpoint's version; reopening at that version puts them back, so a
kill between the store writes and the checkpoint leaves nothing half-applied. In memory:
reopening replays the snapshot and the journal's records up to the checkpoint's version and
cuts off any later record (a round that was not checkpointed, or a record cut short by a
kill). Either way the checkpoint also holds a CRC-32 of every row written: on reopening, a file
of the wrong size, a missing file or a row that does not match is an error, never a silently
zeroed or altered model.

What a write puts in the store's files reaches the system's page cache, which outlives the
process: a killed run (SIGKILL, the OOM killer) resumes to the same numbers. It is not forced
to the disk each round (the checkpoint is): that would write every sampled row through to the
disk before the round may end, where the page cache writes it back on its own. After a power
cut, a store behind its checkpoint is found on resume (a journal that ends early, a row whose
CRC does not match) and refused in one line.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import json
import mmap
import os
import shutil
import struct
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
RAM = 2 * 2**30  # the default budget of a store kept in memory (run.store_ram)
FOLD = 2  # the journal is folded into a snapshot once it holds this many stores' worth of rows
# the files a store named NAME keeps in its run directory, NAME + each: its rows (mapped), the
# undo log of those rows, the journal of a store kept in memory, and that journal's snapshot
FILE_SUFFIXES = (".f32", ".undo.safetensors", ".journal", ".snapshot.safetensors")
JOURNAL_MAGIC = b"STOCFLJ1"  # opens every journal record: the magic, the header's length, the header, the rows

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
    """N rows of P float32 numbers; ``ram``: the bytes it may take in memory with a ``directory``
    (beyond them it is a file mapped from there). A store that exists in the directory keeps
    the form it was written in, whatever the budget now."""

    def __init__(
        self, n_clients: int, n_params: int, directory: Path | None = None, name: str = "clients", ram: int = RAM
    ):
        self.n, self.p = n_clients, n_params
        self.has = np.zeros(n_clients, dtype=bool)
        self.crc = np.zeros(n_clients, dtype=np.int64)
        self.version = 0
        self.existed = False
        self.trusted = False  # rows this process wrote or verified
        self.read_only = _READ_ONLY.get()  # see read_only(): nothing written to disk
        files = [None if directory is None else Path(directory) / f"{name}{s}" for s in FILE_SUFFIXES]
        self.path, self.undo_path, self.journal, self.snapshot = files
        self.in_ram = False  # kept in memory with a journal on disk
        self.stated = 0  # the version of the last checkpoint taken or loaded: the one a snapshot may hold
        self.covered: set[int] = set()  # on disk: rows whose checkpoint value the undo file holds or needs not
        size = n_clients * n_params * 4
        if self.path is not None and not (self.path.exists() or self.path.is_symlink()):
            assert self.journal is not None and self.snapshot is not None
            kept = [f for f in (self.journal, self.snapshot) if f.exists() or f.is_symlink()]
            self.in_ram = bool(kept) or size <= ram
            self.existed = bool(kept)
        if self.path is None or self.in_ram or (self.read_only and not self.path.exists()):
            self.rows: np.ndarray = np.zeros((n_clients, n_params), dtype=np.float32)
        elif self.read_only:
            self.existed = True
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
        if self.in_ram:
            self._journal(ids, rows)
        elif self.undo_path is not None and not self.read_only:
            self._undo(ids)
        for i in ids:
            row = rows[i].numpy()
            self.rows[i] = row
            self.has[i] = True
            self.crc[i] = _crc(row)
        self.trusted = True
        self.version += 1

    def _undo(self, ids: list[int]) -> None:
        """Keep, before they are overwritten, the rows as the last checkpoint has them: those of
        ``ids`` that held a model then (the others are unset at the checkpoint), added to the
        ones kept by earlier writes since it (a store written twice in a round)."""
        assert self.undo_path is not None
        if self.version == self.stated:
            self.covered = set()
            kept_ids, kept = [], None
        else:
            kept, meta = checkpoint.load(self.undo_path)
            kept_ids = meta["ids"]
        need = [i for i in ids if self.has[i] and i not in self.covered]
        self.covered |= set(ids)
        rows = ([kept["rows"][k].numpy() for k in range(len(kept_ids))] if kept is not None else []) + [
            self.rows[i] for i in need
        ]
        checkpoint.save_rows(
            self.undo_path,
            "rows",
            iter(rows),
            len(rows),
            self.p,
            {"version": self.version + 1, "base": self.stated, "ids": kept_ids + need},
            sync=False,
        )

    def _journal(self, ids: list[int], rows: dict[int, torch.Tensor]) -> None:
        """Append version + 1's record (its rows as given); first fold the journal into a
        snapshot where it has outgrown the store and the rows are those of the last
        checkpoint (a snapshot never holds a version no checkpoint has seen)."""
        if self.read_only:
            return
        assert self.journal is not None and self.snapshot is not None
        if (
            self.version == self.stated
            and self.journal.exists()
            and self.journal.stat().st_size > FOLD * self.n * self.p * 4
        ):
            had = np.flatnonzero(self.has).tolist()
            checkpoint.save_rows(
                self.snapshot,
                "rows",
                (self.rows[i] for i in had),
                len(had),
                self.p,
                {"version": self.version, "ids": had},
                sync=False,
            )
            os.close(open_nofollow(self.journal, os.O_WRONLY | os.O_TRUNC))
        self.journal.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"version": self.version + 1, "ids": ids}).encode()
        fd = open_nofollow(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        end = os.fstat(fd).st_size
        try:
            with open(fd, "ab", closefd=False) as f:
                f.write(JOURNAL_MAGIC + struct.pack("<Q", len(head)) + head)
                for i in ids:
                    f.write(memoryview(np.ascontiguousarray(rows[i].numpy(), dtype=np.float32)).cast("B"))
        except OSError as err:  # the rows in memory are still those before: resume goes on from them
            with contextlib.suppress(OSError):  # no record cut short for a later append to follow
                os.ftruncate(fd, end)
            raise UserError(
                f"{self.journal}: cannot append {_size(len(ids) * self.p * 4)} of client models "
                f"({err.strerror or err}); free disk space, then resume the run"
            ) from None
        finally:
            os.close(fd)

    def _replay(self, version: int) -> None:
        """The rows as of ``version``, from the snapshot and the journal; a later record (a
        round no checkpoint saw, or one cut short) is cut off the journal."""
        assert self.journal is not None and self.snapshot is not None
        self.rows[:] = 0
        at = 0
        if self.snapshot.exists() or self.snapshot.is_symlink():
            os.close(open_nofollow(self.snapshot, os.O_RDONLY))
            old, meta = checkpoint.load(self.snapshot)
            at = int(meta["version"])
            if at > version:
                raise UserError(
                    f"{self.snapshot} holds version {at} of the store, later than the checkpoint's {version} "
                    f"(written by another run?); the run cannot resume"
                )
            self.rows[meta["ids"]] = old["rows"].numpy()
        if not (self.journal.exists() or self.journal.is_symlink()):
            if at != version:
                raise UserError(f"{self.journal} is missing; the checkpoint needs its records, the run cannot resume")
            return
        fd = open_nofollow(self.journal, os.O_RDONLY)
        try:  # mapped, not read: the journal may hold twice the store
            size = os.fstat(fd).st_size
            data = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        finally:
            os.close(fd)
        try:
            pos = self._apply(data, at, version)
        finally:
            if isinstance(data, mmap.mmap):
                data.close()
        if pos < size and not self.read_only:  # later records: rounds this checkpoint never saw
            fd = open_nofollow(self.journal, os.O_WRONLY)
            try:
                os.ftruncate(fd, pos)
            finally:
                os.close(fd)

    def _apply(self, data, at: int, version: int) -> int:
        """Apply the journal's records after version ``at`` (the snapshot's) up to ``version``;
        where the applied ones end."""
        pos, row_bytes = 0, self.p * 4
        while at < version:
            record = _record(data, pos, row_bytes, self.n)
            if record is None:
                raise UserError(
                    f"{self.journal} ends at version {at} of the store, the checkpoint has {version} (cut short "
                    f"or damaged); the run cannot resume"
                )
            v, ids, start, end = record
            if v > at:
                if v != at + 1:
                    raise UserError(f"{self.journal}: version {at + 1} is missing (damaged); the run cannot resume")
                if ids:
                    self.rows[ids] = np.frombuffer(data, np.float32, len(ids) * self.p, start).reshape(len(ids), -1)
                at = v
            pos = end
        return pos

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The checkpoint's part: the version and which rows are set; the rows themselves only
        when the store lives in memory with no run directory (otherwise they are in its files)."""
        has = np.flatnonzero(self.has).tolist()
        tensors = {"rows": torch.from_numpy(self.rows[has].copy())} if self.path is None and has else {}
        if has:
            tensors["crc"] = torch.from_numpy(self.crc[has].copy())
        self.stated = self.version
        return tensors, {"version": self.version, "has": has, "format": FORMAT}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Back to the checkpoint's version (undoing a write the checkpoint did not see)."""
        if "rows" in tensors:
            self.rows[meta["has"]] = tensors["rows"].numpy()
        if self.in_ram:
            if not self.trusted or self.version != meta["version"]:
                self._replay(meta["version"])
        elif self.undo_path is not None and self.undo_path.exists():
            old, undo = checkpoint.load(self.undo_path)
            # the rows of the checkpoint this undo file was kept for (older files: of the write before)
            if undo.get("base", meta["version"]) == meta["version"] and undo["version"] > meta["version"]:
                for k, i in enumerate(undo["ids"]):
                    self.rows[i] = old["rows"][k].numpy()
                if isinstance(self.rows, np.memmap) and not self.read_only:
                    self.rows.flush()
        self.version = self.stated = meta["version"]
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
        if self.path is not None and ids and not self.existed and not self.in_ram:  # (read-only: not created)
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


def _record(data: bytes, pos: int, row_bytes: int, n_rows: int) -> tuple[int, list[int], int, int] | None:
    """The journal record at ``pos``: (version, ids, where its rows start, where it ends), or
    None where there is none whole (the end, or a record cut short or damaged)."""
    n = len(JOURNAL_MAGIC)
    if data[pos : pos + n] != JOURNAL_MAGIC or pos + n + 8 > len(data):
        return None
    (length,) = struct.unpack_from("<Q", data, pos + n)
    start = pos + n + 8 + length
    try:
        head = json.loads(data[pos + n + 8 : start])
        version, ids = int(head["version"]), [int(i) for i in head["ids"]]
    except (ValueError, TypeError, KeyError):
        return None
    if any(not 0 <= i < n_rows for i in ids):
        return None
    end = start + len(ids) * row_bytes
    return None if start > len(data) or end > len(data) else (version, ids, start, end)


def _crc(row: np.ndarray) -> int:
    """CRC-32 of one row's float32 bytes."""
    return zlib.crc32(memoryview(np.ascontiguousarray(row, dtype=np.float32)).cast("B"))
