"""The agent's data directory: one agent at a time (an exclusive lock), and the operator's store repair.

Two processes with one data_dir would act as one acceptor with two states (a broken promise is a broken
I1), so `lock()` takes an exclusive `flock` on `<data_dir>/LOCK` for the life of the process and refuses to
start when another process holds it, naming that process. The kernel drops the lock when the holder exits,
`kill -9` included, so a crash never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from agent.disk import fsync_dir, write_atomic

LOCK_NAME = "LOCK"
LOG_NAME = "consensus"
IDENTITY_NAME = "IDENTITY"  # the node id that owns this data_dir, written once its store first opened
FORMAT_NAME = "FORMAT"  # the data_dir's format (elasticmoe/versions.py), written with IDENTITY (absent: 1)


class DataDirError(RuntimeError):
    """The data_dir cannot be used: held by another agent, or not writable."""


class DataDirLock:
    """An exclusive lock on a data_dir, held until `release()` or the process exits."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self._fd = -1

    def acquire(self) -> DataDirLock:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DataDirError(f"data_dir = {str(self.data_dir)!r}: cannot be used: {e.strerror or e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirError(f"data_dir = {str(self.data_dir)!r} is in use by another agent (pid {holder}): "
                               f"two agents on one data_dir would be one acceptor with two states; stop the "
                               f"other one or give this one its own data_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = -1

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def data_dir_format(data_dir: str | Path) -> int:
    """The data_dir's layout format (1 where none is recorded, as before the file). Raises DataDirError when it
    is newer than this release knows, or unreadable: a node never runs on a layout it does not know."""
    from elasticmoe.versions import DATADIR_FORMAT

    path = Path(data_dir) / FORMAT_NAME
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 1
    except (OSError, UnicodeDecodeError) as e:
        raise DataDirError(f"data_dir = {str(data_dir)!r}: cannot read {FORMAT_NAME}: {e}") from e
    if not text.isdigit() or int(text) < 1:
        raise DataDirError(f"data_dir = {str(data_dir)!r}: {FORMAT_NAME} holds {text[:32]!r}, not a format number")
    if int(text) > DATADIR_FORMAT:
        raise DataDirError(f"data_dir = {str(data_dir)!r} has format {int(text)}, written by a newer release; this "
                           f"agent knows data_dir formats up to {DATADIR_FORMAT}: run the newer release on it")
    return int(text)


def owner(data_dir: str | Path, node_id: str) -> bool:
    """Whether this node ran on `data_dir` before (its identity marker is there). Raises DataDirError when
    the data_dir belongs to another node id, or is of a newer format than this release knows."""
    data_dir_format(data_dir)
    path = Path(data_dir) / IDENTITY_NAME
    try:
        found = path.read_text().strip()
    except FileNotFoundError:
        return False
    except OSError as e:
        raise DataDirError(f"data_dir = {str(data_dir)!r}: cannot read {IDENTITY_NAME}: {e.strerror or e}") from e
    if found != node_id:
        raise DataDirError(f"data_dir = {str(data_dir)!r} belongs to node {found!r}, not {node_id!r}: give each "
                           f"node its own data_dir")
    return True


def mark_owner(data_dir: str | Path, node_id: str) -> None:
    """Record durably that `node_id` runs on `data_dir` (an empty store found later was lost, not new), and the
    data_dir's format."""
    from elasticmoe.versions import DATADIR_FORMAT

    write_atomic(Path(data_dir) / FORMAT_NAME, f"{DATADIR_FORMAT}\n".encode())
    write_atomic(Path(data_dir) / IDENTITY_NAME, f"{node_id}\n".encode())


def repair(data_dir: str | Path) -> Path | None:
    """Move the consensus log aside (kept for inspection, never deleted) so that the node rebuilds its state
    from its peers at the next start, as a learner. Refuses while an agent holds the data_dir. Returns where
    the old log went, or None when there was none."""
    with DataDirLock(data_dir):
        log_path = Path(data_dir) / LOG_NAME
        if not log_path.exists():
            return None
        aside = log_path.with_name(f"{LOG_NAME}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
        os.replace(log_path, aside)
        fsync_dir(Path(data_dir))
        return aside
