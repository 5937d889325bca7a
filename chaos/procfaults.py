"""Disk faults for the process runner, on real files: each agent's data_dir on a tmpfs of its own (a disk that
can fill up), a filler file that takes its last byte, a byte flipped in the middle of a log, a log cut at a record boundary,
a log lost, a whole data_dir wiped.
Root only (mount); without it the runner leaves the disk faults out and says so in its report."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

from chaos.quorumsim import cut_point

FILLER = "filler"


def mount_tmpfs(where: Path, size: str = "16m") -> str:
    """Mount a tmpfs of `size` on `where` (made if missing); "" on success, else why not."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True, timeout=10)
    return "" if r.returncode == 0 else f"mount tmpfs: {r.stderr.strip()}"


def umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


def fill(data_dir: Path) -> int:
    """Write a filler file until the disk is full; returns the bytes it took."""
    fd = os.open(data_dir / FILLER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    n = 0
    try:
        while True:
            n += os.write(fd, bytes(4096))
    except OSError as e:
        if e.errno != errno.ENOSPC:
            raise
    finally:
        os.close(fd)
    return n


def unfill(data_dir: Path) -> None:
    (data_dir / FILLER).unlink(missing_ok=True)


def flip_mid_log(log: Path, seed: int) -> int | None:
    """Flip one byte in the middle half of `log` (a damaged sector); returns its offset (None: log too short)."""
    data = bytearray(log.read_bytes())
    if len(data) < 256:
        return None
    at = len(data) // 4 + seed % (len(data) // 2)
    data[at] ^= 0x5A
    log.write_bytes(bytes(data))
    return at


def cut_log(log: Path, records: int) -> int:
    """Cut the log before its last `records` whole records (an older copy of the file: it still parses);
    returns the bytes cut (0: no log)."""
    if not log.exists():
        return 0
    data = log.read_bytes()
    keep = cut_point(data, records)
    with log.open("r+b") as f:
        f.truncate(keep)
        os.fsync(f.fileno())
    return len(data) - keep


def lose_log(log: Path) -> bool:
    """The log is gone (a replaced disk whose data_dir marker survived): moved aside, as repair does."""
    if not log.exists():
        return False
    os.replace(log, log.with_name(log.name + ".lost"))
    return True


def wipe_data_dir(data_dir: Path) -> int:
    """Everything in the data_dir is gone, its IDENTITY marker with the log (a node rebuilt from a blank disk
    image): the restart cannot tell that it ran before. The directory itself (a mount point) stays. Returns
    the entries removed."""
    gone = 0
    for entry in data_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        gone += 1
    return gone
