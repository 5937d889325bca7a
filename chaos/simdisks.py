"""Disk faults of the simulated cluster: a lost store, a whole data_dir wiped, a log cut at a record boundary,
a byte flipped mid-log, a full disk (each node's MemoryDisk, and `SimCluster.identity` for the data_dir's
IDENTITY marker), and faults armed for a node's next durable promise, accept or commit. The process runner
does the same on real files (chaos/procfaults.py)."""

from __future__ import annotations

import random
from collections.abc import Callable

from agent.consensus.node import ConsensusNode
from agent.storage.store import MemoryDisk, Store, StoreCorrupt
from chaos.quorumsim import cut_log as cut_records
from chaos.simcluster import SimCluster


def rebuilding(c: SimCluster, n: str) -> str:
    """Why a store fault on `n` now would go beyond what rebuild tolerates, or "": one lost store at a time
    (agent/consensus/rebuild.py), so none while another voter still rebuilds (two at once can leave too few
    voters that may vote, and the cluster stalls for good: a 3-node schedule, a wipe then a corrupt log)."""
    busy = sorted(m for m, st in c.states.items() if m != n and m not in c.down
                  and isinstance(st.consensus, ConsensusNode) and st.consensus.rebuild is not None)
    if not busy:
        return ""
    c._ev("store-fault-skipped", n)
    return f"skipped: {', '.join(busy)} still rebuilding"


def lose_store(c: SimCluster, n: str) -> str:
    """kill -9, and the node's disk is replaced: it restarts with an empty store and must rebuild as a
    learner (no vote on any version it may have voted on before)."""
    why = rebuilding(c, n)
    if why:
        return f"lose-store {n} {why}"
    c.crash(n)
    c._fault(f"lose-store {n}")
    c.disks[n] = MemoryDisk()
    c._ev("wipe", n)
    c.restart(n)
    return f"lose-store {n}"


def wipe_data_dir(c: SimCluster, n: str, restart_after: float | None = 0.0) -> str:
    """kill -9, and the node's whole data_dir is gone: its store (the disk emptied) and its IDENTITY marker, so
    that it restarts with `had_store` False and only the other voters' enrolment records can tell that it
    ran before. `restart_after`: seconds until it restarts (a supervisor; None: left down for `restart`).
    Returns what happened, for the report (with the head it had: genesis means before the first commit).
    While another voter is still rebuilding (`rebuilding`) the data_dir is kept: only the kill -9 and restart."""
    why = rebuilding(c, n)
    head = c.states[n].head_version()
    c.crash(n)
    if not why:
        c._fault(f"wipe-data-dir {n}")
        c.disks[n] = MemoryDisk()
        c.identity.discard(n)
        c._ev("wipe", n, version=head)
        c.history.wipes.append((n, c.clock.now(), head))
    if restart_after == 0.0:
        c.restart(n)
    elif restart_after is not None:
        inc = c.incarnation[n]
        c.clock.call_later(restart_after, lambda: c.restart(n) if c.incarnation[n] == inc and n not in c.lost else None)
    return f"wipe-data-dir {n} (head v{head})" + (f": data_dir kept, {why}" if why else "")


POINTS = ("after-promise", "after-accept", "after-commit")


def arm(c: SimCluster, n: str, point: str, action: Callable[[], object]) -> None:
    """Run `action` once, at n's next durable promise, accept or commit (`point`, one of POINTS): after a
    promise or an accept, once its reply has left (the proposer gets the vote, nothing later reaches n);
    after a commit, before anything more leaves n (a proposer's Learn included: then only its own disk and
    the voters that chose the value know it). The cluster's stabilize drops what has not fired."""
    if point not in POINTS:
        raise ValueError(f"{point!r}: expected one of {', '.join(POINTS)}")
    kind = point.removeprefix("after-")

    def strike() -> None:
        action()

    def fire() -> None:
        if kind == "commit":
            c.net.crash(n)  # the process dies here: nothing more leaves it
        c.clock.call_later(0.0, strike)

    c.tripwires.setdefault(n, []).append((kind, fire))


def cut_log(c: SimCluster, n: str, rng: random.Random) -> str:
    """kill -9, the node's log loses its last 1-4 whole records (a file restored from an older copy, a disk
    that dropped acknowledged writes): it still parses, so only the high-water mark beside it tells; the node
    must rebuild as a learner. Returns what happened, for the report."""
    why = rebuilding(c, n)
    if why:
        return f"cut-log {n} {why}"
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
    why = rebuilding(c, n)
    if why:
        return f"corrupt {n} {why}"
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
