"""Writing files so that a kill at any moment leaves the old version or the new one, never a
mix: write a temporary file beside the target, fsync it, rename it over the target, fsync the
directory."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import struct
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from stocfl.errors import InUse, UserError

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one process per results directory is then the user's care
    fcntl = None  # type: ignore[assignment]

LOCK = ".lock"
_held: dict[tuple[int, Path], list[int]] = {}  # (pid, lock file) -> [fd, depth]: re-entrant; a forked child holds none


NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file in a run directory, never through a symbolic link (O_NOFOLLOW): a
    link there (to a file elsewhere, which the run would truncate, append to or map) is one
    line instead."""
    try:
        return os.open(path, flags | NOFOLLOW, mode)
    except OSError as err:
        if err.errno == errno.ELOOP or (not NOFOLLOW and Path(path).is_symlink()):
            raise UserError(
                f"{path} is a symbolic link; a run's files are never written through one: replace it with a "
                f"plain file or remove it"
            ) from None
        raise


def write_atomic(path: Path, data: bytes | str) -> None:
    write_atomic_with(path, lambda f: f.write(data.encode() if isinstance(data, str) else data))


def write_atomic_with(path: Path, write: Callable[[BinaryIO], object], sync: bool = True) -> None:
    """What ``write(f)`` writes into the open file ``f``, at ``path`` whole or not at all: into a
    temporary file, forced to the disk, then renamed into place (a file written in parts, none
    of which need be in memory at once). ``sync=False`` leaves the forcing to the system: a
    killed process still leaves the old file or the new one."""
    path = Path(path)
    # a name of its own: two processes writing one file (two reproductions of one table's rows)
    # must not rename each other's half-written copy
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if sync:
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


def save_figure(fig, path: Path, dpi: int = 110, tight: bool = False) -> None:
    """``tight``: the image grows to take in every artist (a legend beside the axes, taller
    than them), where the figure's own size would clip it."""
    buf = io.BytesIO()
    fig.savefig(
        buf,
        dpi=dpi,
        format=Path(path).suffix.lstrip(".") or "png",
        **({"bbox_inches": "tight", "pad_inches": 0.1} if tight else {}),
    )
    write_atomic(path, buf.getvalue())


@contextlib.contextmanager
def exclusive(directory: Path, wait: bool = False, lock: str = LOCK) -> Iterator[None]:
    """Hold ``directory`` (a run's results) for this process while it writes there: another
    process that tries gets one line naming the holder (with ``wait``, it waits its turn: for
    short read-modify-write steps), never two writers interleaving one run's metrics and
    checkpoint. ``lock`` names the file in ``directory`` that carries the lock. POSIX record
    locks: per process, so forked workers do not inherit them and this process may take one
    it holds again; the system drops them when the holder dies, SIGKILL included."""
    directory = Path(directory).resolve()
    if fcntl is None:
        yield
        return
    key = (os.getpid(), directory / lock)
    if key not in _held:
        try:
            fd = open_nofollow(directory / lock, os.O_RDWR | os.O_CREAT)
        except OSError as err:
            raise UserError(
                f"{directory}: cannot open {lock} to write there ({err.strerror}); check the directory "
                f"and its permissions"
            ) from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise InUse(
                f"{directory} is in use by another process (pid {holder}); let it finish or stop it, "
                f"then continue the run with 'stocfl resume {directory}'"
            ) from None
        _held[key] = [fd, 0]
    _held[key][1] += 1
    try:
        if _held[key][1] == 1:  # the holder's pid, for the line another process gets
            os.ftruncate(_held[key][0], 0)
            os.pwrite(_held[key][0], f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        _held[key][1] -= 1
        if not _held[key][1]:
            os.close(_held.pop(key)[0])  # closing this process's last descriptor of the file releases the lock


def holder(directory: Path, lock: str = LOCK) -> int | None:
    """The pid of the process holding ``directory`` (see :func:`exclusive`), or None: free,
    or not knowable on this system. It asks the kernel (F_GETLK) and takes nothing."""
    key = (os.getpid(), Path(directory).resolve() / lock)
    if key in _held:  # never open a second descriptor here: closing it would drop the lock
        return os.getpid()
    if fcntl is None or not sys.platform.startswith("linux"):  # struct flock's layout is Linux's
        return None
    try:
        fd = os.open(key[1], os.O_RDWR)
    except OSError:
        return None
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
        kind, _, _, _, pid = struct.unpack("hhqqi", got)
        return None if kind == fcntl.F_UNLCK else pid
    except OSError:
        return None
    finally:
        os.close(fd)
