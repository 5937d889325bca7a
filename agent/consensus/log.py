"""CommittedLog: the certified routing tables a node holds, installed strictly in version order.

A commit is checked (certificate, content hash, parent), made durable in the Store, then installed (head
moves, callbacks run). Commits that arrive early wait in a small buffer until their parent is installed.
Installed versions never go down and each one's parent is the previous one (I2).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.consensus.paxos import check_certificate
from agent.consensus.refusal import Refusal
from agent.storage.store import Recovered, Store
from controlplane.errors import ControlPlaneError
from controlplane.table import RoutingTable
from elasticmoe.codec import TableWireError, table_from_pb
from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)

InstallHook = Callable[[pb.Commit, RoutingTable], None]
BAD = pb.REFUSAL_INVALID_ARGUMENT  # a commit that is not certified, decodes to no valid table, or has another parent


def shape_mismatch(table: RoutingTable, head: RoutingTable) -> str:
    """Why `table` cannot follow `head` (another number of layers or experts), or ""."""
    if (table.layers, table.experts) != (head.layers, head.experts):
        return (f"table.layers = {table.layers}, table.experts = {table.experts}: expected {head.layers} "
                f"and {head.experts} (the committed head's)")
    return ""


def parent_hash_mismatch(table: RoutingTable, head: RoutingTable) -> str:
    """Why `table` (version head + 1) does not build on `head` by hash, or ""."""
    if table.parent_hash == head.digest:
        return ""
    return (f"parent hash {table.parent_hash.hex()[:12] or '(none)'} of version {table.version}: expected "
            f"{head.digest.hex()[:12]}, this node's version {head.version}")


class CommittedLog:
    def __init__(self, store: Store, voters: list[str], genesis: RoutingTable, on_install: InstallHook,
                 max_buffered: int = 64, ride_along: Callable[[int], list[pb.AcceptorState]] | None = None,
                 verify_qc: Callable[[pb.Commit, list[str]], str] | None = None) -> None:
        self.store = store
        self.voters = sorted(set(voters))
        self.head = genesis
        self.genesis_version = genesis.version
        self.commits: dict[int, pb.Commit] = {}
        self.future: dict[int, pb.Commit] = {}
        self.on_install = on_install
        self.max_buffered = max_buffered
        self.ride_along = ride_along  # acceptor states to make durable with the commit of a version
        self.verify_qc = verify_qc  # under mTLS: every named voter's signature (agent.consensus.signing)
        self.conflicts: list[str] = []  # a certified commit that disagrees with ours: a broken invariant
        self.base = 0  # the version last installed as a snapshot (its parent is not the previous head)
        self.snapshots = 0  # how many snapshots this incarnation installed

    def recover(self, rec: Recovered) -> None:
        """Adopt the commits the store recovered (already durable: no callbacks, no re-append)."""
        for c in rec.commits:
            v = int(c.table.version)
            if v <= self.head.version:
                self.commits.setdefault(v, c)
                continue
            try:
                t = table_from_pb(c.table, self.head.topology)
            except TableWireError as e:
                log.error("store: commit for version %d unreadable: %s", v, e)
                break
            if t.parent != self.head.version and (self.commits or v <= self.head.version + 1):
                log.error("store: commit %d has parent %d, head is %d", v, t.parent, self.head.version)
                break
            chain = parent_hash_mismatch(t, self.head) if t.parent == self.head.version else ""
            if chain:
                self._conflict(f"store: commit {v}: {chain}")
                break
            # (a first commit beyond genesis + 1 is the base of a compacted log: our own certified record)
            self.commits[v] = c
            self.head = t

    def _certified(self, c: pb.Commit) -> str:
        """Why `c` is not a certified commit of our voters (who signed, when signatures are checked), or ""."""
        why = check_certificate(c, self.voters)
        if not why and self.verify_qc is not None:
            why = self.verify_qc(c, self.voters)
        return why

    def _decode(self, c: pb.Commit) -> tuple[RoutingTable | None, str]:
        """The commit's table, decoded and checked (byte lengths, content hash, shape, validity), or why not."""
        try:
            table = table_from_pb(c.table, self.head.topology)
        except TableWireError as e:
            return None, f"INVALID_ARGUMENT: {e}"
        why = shape_mismatch(table, self.head)
        if not why:
            try:
                table.validate()  # a certified but invalid table is refused too (I3): never installed
            except ControlPlaneError as e:
                why = f"invalid table: {e}"
        return (None, f"INVALID_ARGUMENT: {why}") if why else (table, "")

    def offer(self, c: pb.Commit, before_install: Callable[[pb.Commit], None] | None = None
              ) -> tuple[Refusal, str, bool]:
        """Validate `c` and install it (and any buffered successors) if it extends the head.

        Returns (why it was refused as a code, and in words, or REFUSAL_UNSPECIFIED and "", whether we are
        behind: the caller should catch up).
        `before_install` runs after the commit is durable and before it is installed (the proposer's send).
        """
        v = int(c.table.version)
        if v <= self.head.version:
            mine = self.commits.get(v)
            if mine is not None and mine.qc.table_hash != c.qc.table_hash:
                # only a whole certified rival (valid table, right parent) is a broken invariant; anything
                # less is bad input, refused without a trace in our state
                why = self._certified(c)
                if why:
                    return BAD, f"INVALID_ARGUMENT: {why}", False
                table, why = self._decode(c)
                if table is not None and table.parent != v - 1:
                    why = f"INVALID_ARGUMENT: version {v} has parent {table.parent}: expected {v - 1}"
                if why:
                    return BAD, why, False
                msg = (f"version {v}: certified table {c.qc.table_hash.hex()[:12]} differs from ours "
                       f"{mine.qc.table_hash.hex()[:12]}")
                return pb.REFUSAL_CONFLICT, self._conflict(msg), False
            return pb.REFUSAL_UNSPECIFIED, "", False
        why = self._certified(c)
        if why:
            return BAD, f"INVALID_ARGUMENT: {why}", False
        table, why = self._decode(c)  # decoded and validated before it is buffered or installed
        if table is None:
            return BAD, why, False
        if v > self.head.version + 1:
            if len(self.future) < self.max_buffered:
                self.future[v] = c
            return pb.REFUSAL_UNSPECIFIED, "", True
        if table.parent != self.head.version:
            return BAD, f"INVALID_ARGUMENT: version {v} has parent {table.parent}: expected {self.head.version}", False
        chain = parent_hash_mismatch(table, self.head)
        if chain:  # a certified table built on another table at our head's version: our histories diverged
            return pb.REFUSAL_CONFLICT, self._conflict(f"certified version {v} does not build on ours: {chain}"), False
        self.store.append_commit(c, self.ride_along(v) if self.ride_along else None)  # 1. persist
        self.commits[v] = c
        if before_install is not None:
            before_install(c)  # 2. send
        self._install(c, table)  # 3. install
        return pb.REFUSAL_UNSPECIFIED, "", False

    def _conflict(self, msg: str) -> str:
        """A certified table that disagrees with one we hold: I1 is broken somewhere. Said loudly (ERROR, and
        the node stops voting and reports NOT_SERVING with it), never built on."""
        if msg not in self.conflicts:
            log.error("I1 broken: %s", msg)
            self.conflicts.append(msg)
        return msg

    def _install(self, c: pb.Commit, table: RoutingTable) -> None:
        """Move the head to `table` (already durable), run the install hook, then any buffered successor."""
        v = table.version
        self.head = table
        self.future = {k: x for k, x in self.future.items() if k > v}
        self.on_install(c, table)
        nxt = self.future.pop(v + 1, None)
        if nxt is not None:
            self.offer(nxt)

    def install_snapshot(self, c: pb.Commit, acceptor: list[pb.AcceptorState]) -> str:
        """Install `c`, a certified commit beyond head + 1 whose predecessors the peers compacted away, as the new
        base of the log. The store is rewritten to just `c` and the acceptor state still open (`acceptor`),
        atomically, before the head moves. Returns why it was refused, or ""."""
        v = int(c.table.version)
        if v <= self.head.version + 1:
            return f"version {v} is not beyond head {self.head.version} + 1: not a snapshot"
        why = self._certified(c)
        if why:
            return f"INVALID_ARGUMENT: {why}"
        table, why = self._decode(c)
        if table is None:
            return why
        if not self.store.compact([c], acceptor):  # 1. persist (the whole log is now this base)
            return f"UNAVAILABLE: could not write the snapshot of version {v} to {self.store.where}"
        log.warning("installed a snapshot of version %d (head was %d; the peers compacted the versions between)",
                    v, self.head.version)
        self.commits = {v: c}
        self.base = v
        self.snapshots += 1
        self._install(c, table)  # 3. install
        return ""

    def trim(self, keep: int) -> list[pb.Commit]:
        """Forget all but the newest `keep` commits (after compaction); returns those kept, in order."""
        versions = sorted(self.commits)
        for v in versions[:-keep] if keep < len(versions) else []:
            del self.commits[v]
        return [self.commits[v] for v in sorted(self.commits)]

    def since(self, version: int) -> list[pb.Commit]:
        return [self.commits[v] for v in sorted(self.commits) if v > version]

    def catchup_reply(self, req: pb.CatchUpRequest, batch: int) -> pb.CatchUpReply:
        first = int(req.from_version) + 1
        if (self.genesis_version < first <= self.head.version and first not in self.commits
                and self.head.version in self.commits):
            # compacted away here: send the head with its certificate, to be installed as a snapshot
            return pb.CatchUpReply(commits=[self.commits[self.head.version]], committed_head=self.head.version,
                                   snapshot=True)
        limit = min(int(req.limit) or batch, batch)
        out: list[pb.Commit] = []
        for v in range(int(req.from_version) + 1, self.head.version + 1):
            c = self.commits.get(v)
            if c is None or len(out) >= limit:
                break
            out.append(c)
        return pb.CatchUpReply(commits=out, committed_head=self.head.version)
