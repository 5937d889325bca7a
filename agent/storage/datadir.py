"""The agent's data directory: one agent at a time (an exclusive lock), and the operator's store repair.

Two processes with one data_dir would act as one acceptor with two states (a broken promise is a broken
I1), so `DataDirLock` takes an exclusive `flock` on `<data_dir>/LOCK` for the life of the process and
refuses to start when another process holds it, naming that process (its pid is written in the file).
The holder removes the file when it lets go (a clean stop, and every failed start), so a LOCK file left
behind means its holder died (`kill -9`, a crash). The lock itself never outlives its holder: the kernel
drops a flock when the process exits, so the next agent takes such a file over, and says so in its log.
Removing the file while others may open it is safe because a taker checks, once it holds the flock, that
the path still names the file it locked (else it locked a removed file, and tries again).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

from agent.storage.disk import fsync_dir, write_atomic

log = logging.getLogger(__name__)

LOCK_NAME = "LOCK"
LOG_NAME = "consensus"
IDENTITY_NAME = "IDENTITY"  # the node id that owns this data_dir, written once its store first opened
FORMAT_NAME = "FORMAT"  # the data_dir's format (elasticmoe/versions.py), written with IDENTITY (absent: 1)
# the cluster fingerprint a quorum of the voters was last heard to hold (agent/fingerprint.py), one line of text;
# absent: none heard yet. Releases before it ignore the file.
FINGERPRINT_NAME = "FINGERPRINT"


class DataDirError(RuntimeError):
    """The data_dir cannot be used: held by another agent, or not writable."""


class DataDirLock:
    """An exclusive lock on a data_dir, held until `release()` (which removes the LOCK file) or the process
    exits."""

    # a holder that lets go between our open and our flock makes us try again; this bounds the tries
    ATTEMPTS = 64

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.path = self.data_dir / LOCK_NAME
        self._fd = -1

    def acquire(self) -> DataDirLock:
        for _ in range(self.ATTEMPTS):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise DataDirError(f"data_dir = {str(self.data_dir)!r} is in use by another agent (pid {holder}): "
                                   f"two agents on one data_dir would be one acceptor with two states; stop the "
                                   f"other one or give this one its own data_dir") from None
            if self._names(fd):
                break
            os.close(fd)  # we locked a file its holder removed on release: lock the one the path names now
        else:
            raise DataDirError(f"data_dir = {str(self.data_dir)!r}: its {LOCK_NAME} file kept changing under us "
                               f"({self.ATTEMPTS} tries): another process is starting and stopping agents there")
        left = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if left:  # its holder died without removing it (kill -9, a crash): the kernel dropped its flock
            log.warning("data_dir %s: took over the %s file left by pid %s, which no longer holds it (it was "
                        "killed or crashed without stopping cleanly)", self.data_dir, LOCK_NAME, left)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DataDirError(f"data_dir = {str(self.data_dir)!r}: cannot be used: {e.strerror or e}") from e

    def _names(self, fd: int) -> bool:
        """Whether the LOCK path still names the file open at `fd`."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def release(self) -> None:
        """Remove the LOCK file, then let go of the lock (closing the descriptor drops the flock)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            if self._names(fd):
                os.unlink(self.path)
        except OSError as e:  # a read-only or vanished data_dir: the flock still goes with the descriptor
            log.warning("data_dir %s: could not remove %s: %s", self.data_dir, LOCK_NAME, e.strerror or e)
        finally:
            os.close(fd)

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
