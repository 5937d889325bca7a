"""Disk faults of the simulated cluster: a lost store, a log cut at a record boundary, a byte flipped mid-log,
a full disk (each node's MemoryDisk). The process runner does the same on real files (chaos/procfaults.py)."""

from __future__ import annotations

import random

from agent.store import MemoryDisk, Store, StoreCorrupt
from chaos.quorumsim import cut_log as cut_records
from chaos.simcluster import SimCluster


def lose_store(c: SimCluster, n: str) -> None:
    """kill -9, and the node's disk is replaced: it restarts with an empty store and must rebuild as a
    learner (no vote on any version it may have voted on before)."""
    c.crash(n)
    c._fault(f"lose-store {n}")
    c.disks[n] = MemoryDisk()
    c._ev("wipe", n)
    c.restart(n)


def cut_log(c: SimCluster, n: str, rng: random.Random) -> str:
    """kill -9, the node's log loses its last 1-4 whole records (a file restored from an older copy, a disk
    that dropped acknowledged writes): it still parses, so only the high-water mark beside it tells; the node
    must rebuild as a learner. Returns what happened, for the report."""
    c.crash(n)
    records = rng.randint(1, 4)
    c._fault(f"cut-log {n} {records}")
    c._ev("cut", n, versions=cut_records(c.disks[n], records))
    c.restart(n)
    return f"cut-log {n}: last {records} records cut"


def corrupt(c: SimCluster, n: str, rng: random.Random) -> str:
    """kill -9, one byte flipped in the middle of the node's log, restart: the store must refuse to start
    (naming the offset), never truncate; then the operator's repair (the log moved aside) and a restart
    that rebuilds from the peers. Returns what happened, for the report."""
    c.crash(n)
    disk = c.disks[n]
    if len(disk.data) < 64:
        c.restart(n)
        return f"corrupt {n}: log too short to corrupt mid-file; restarted"
    at = rng.randrange(len(disk.data) // 4, len(disk.data) // 2)
    disk.data[at] ^= 0x5A
    try:
        Store(disk=disk).open()
    except StoreCorrupt as e:
        c._fault(f"corrupt {n} at byte {at}: refused to start (offset {e.offset}); repaired")
        c.disks[n] = MemoryDisk()
        c._ev("wipe", n)
        c.restart(n)
        return f"corrupt {n}: refused at offset {e.offset}, repaired, rebuilding"
    raise AssertionError(f"{n}: a byte flipped at {at} of {len(disk.data)} went unnoticed by the store")


def disk_full(c: SimCluster, n: str, seconds: float) -> None:
    """The node's disk takes nothing more for `seconds`: it fail-stops its votes, then resumes."""
    if n in c.down:
        return
    c._fault(f"disk-full {n} {seconds:g}s")
    disk = c.disks[n]
    disk.capacity = len(disk.data)

    def recover(d: MemoryDisk = disk) -> None:
        d.capacity = None

    c.clock.call_later(seconds, recover)
