"""A simulated consensus cluster for scenario tests and chaos schedules.

`QuorumSim` runs ConsensusNodes on agent.transport.sim.SimNetwork (seeded latency, loss, duplication,
reordering, partitions, crashes) in virtual time, each node with a MemoryDisk that survives its crashes,
and records a history of installs, accepts, proposals, crashes and recoveries for chaos/checkers.py.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.clock import FakeClock
from agent.config import ConsensusConfig
from agent.consensus.node import ConsensusNode, Outcome
from agent.storage.store import MemoryDisk, Store, parse
from agent.transport.sim import SimNetwork
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as pb


def cut_point(data: bytes, records: int) -> int:
    """Where a log must end to lose its last `records` whole records (a cut at a record boundary)."""
    ends = parse(data)[0].ends
    return ends[-records - 1] if len(ends) > records else 0


def cut_log(disk: MemoryDisk, records: int) -> tuple[int, ...]:
    """Cut `disk`'s log before its last `records` whole records; returns the committed versions it keeps."""
    del disk.data[cut_point(bytes(disk.data), records):]
    return tuple(sorted(int(c.table.version) for c in parse(bytes(disk.data))[0].commits))


@dataclass
class HistoryEvent:
    """One entry of a recorded history (chaos/checkers.py reads these).

    kind: "install" (a node installed a commit), "accept" (a voter durably accepted `digest` at `ballot`;
    `quorum` voters accepting one ballot choose it), "invoke"/"respond" (a proposal and its outcome;
    `result` is "ok", "fail" (another table was chosen) or "unknown"), "crash" (versions: what the node
    had installed), "recover" (versions: what the restarted node recovered from its store), "wipe" (the
    node's store was lost while it was down: it restarts from genesis and rebuilds), "cut" (its log lost
    its last records while it was down; versions: the commits it keeps).
    """

    kind: str
    node: str
    t: float
    seq: int
    version: int = 0
    parent: int = 0
    digest: bytes = b""
    valid: bool = True
    result: str = ""
    op: int = -1
    versions: tuple[int, ...] = ()
    incarnation: int = 0
    snapshot: bool = False  # an install of a snapshot: its parent is not the node's previous version
    ballot: tuple[int, str] = (0, "")
    quorum: int = 0


def successor_table(head: RoutingTable, rng: random.Random) -> RoutingTable:
    """A valid table for head.version + 1: one replica added in a free slot, or one spare replica removed."""
    phy = head.phy2log.copy()
    L, P = phy.shape
    S = head.topology.slots_per_rank
    for _ in range(4 * L * P):
        layer, slot = rng.randrange(L), rng.randrange(P)
        rank = slot // S
        row = phy[layer, rank * S:(rank + 1) * S]
        if phy[layer, slot] < 0:
            e = rng.randrange(head.experts)
            if e not in row:
                phy[layer, slot] = e
                return head.successor(phy)
        elif int((phy[layer] == phy[layer, slot]).sum()) > 1:
            phy[layer, slot] = -1
            return head.successor(phy)
    raise RuntimeError(f"no successor found for table version {head.version}")


class QuorumSim:
    """`nodes` consensus nodes (`voters` of them, drawn from the seed, vote; all learn) on a SimNetwork,
    each with a MemoryDisk that survives crashes, recording a history for the checkers."""

    def __init__(self, nodes: int, voters: int, seed: int, cfg: ConsensusConfig | None = None,
                 genesis: RoutingTable | None = None, signers: dict[str, Any] | None = None) -> None:
        if not 1 <= voters <= nodes:
            raise ValueError(f"voters = {voters}: expected 1..nodes = {nodes}")
        self.rng = random.Random(seed)
        self.clock = FakeClock()
        self.net = SimNetwork(self.clock, seed)
        self.down: set[str] = set()
        self.cfg = cfg or ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=500)
        self.genesis = genesis or initial_table(Topology(2, 2, 4), 2, 8)
        self.ids = [f"n{i:02d}" for i in range(nodes)]
        self.voters = sorted(self.rng.sample(self.ids, voters))
        self.disks = {n: MemoryDisk() for n in self.ids}
        self.signers = signers or {}  # node id -> agent.consensus.signing.VoteSigner (mTLS clusters)
        self.nodes: dict[str, ConsensusNode] = {}
        self.incarnation = dict.fromkeys(self.ids, 0)
        self.identity: set[str] = set()  # nodes whose data_dir holds its IDENTITY marker (it ran before)
        self.history: list[HistoryEvent] = []
        self.outcomes: list[tuple[str, Outcome]] = []
        self._seq = 0
        self._ops = 0
        for n in self.ids:
            self._boot(n)

    def _ev(self, kind: str, node: str, **kw: Any) -> HistoryEvent:
        self._seq += 1
        e = HistoryEvent(kind, node, self.clock.now(), self._seq, incarnation=self.incarnation[node], **kw)
        self.history.append(e)
        return e

    def live_voters(self) -> list[str]:
        return [v for v in self.voters if v not in self.down]

    def _boot(self, n: str) -> None:
        store = RecordingStore(self, n, self.disks[n], len(self.voters) // 2 + 1)
        node = ConsensusNode(n, self.voters, store, self.net.clock(n), self.net.transport(n), self.cfg,
                             self.genesis, live_voters=self.live_voters, members=lambda: self.ids,
                             rng=random.Random(self.rng.random()), had_store=n in self.identity,
                             enrolment=zlib.crc32(f"{n}/{len(self.history)}".encode()) | 1,  # new each boot
                             signer=self.signers.get(n))

        def installed(c: pb.Commit, t: RoutingTable, n: str = n) -> None:
            self._ev("install", n, version=t.version, parent=t.parent, digest=t.digest, valid=t.is_valid(),
                     snapshot=node.log.base == t.version)

        node.on_commit(installed)
        node.start()
        self.identity.add(n)  # written once its store first opened
        self.nodes[n] = node

    def up(self) -> list[str]:
        return [n for n in self.ids if n not in self.down]

    def crash(self, n: str, tear: bool = False, lose_store: bool = False, cut_records: int = 0,
              wipe_data_dir: bool = False) -> None:
        """kill -9 of `n`. `tear`: a record torn mid-write is left at the end of its log; `lose_store`: the disk
        is replaced (an empty store); `cut_records`: its log loses its last N whole records (cut at a record
        boundary, as a file restored from an older copy would be); `wipe_data_dir`: the whole data_dir is gone,
        its IDENTITY marker with the store, so that the restart cannot tell it ran before."""
        node = self.nodes[n]
        if n in self.down:
            return
        self._ev("crash", n, versions=tuple(sorted(node.log.commits)))
        self.net.crash(n)
        self.down.add(n)
        node.stop()
        if tear:  # a record torn mid-write: a header promising more bytes than follow
            self.disks[n].tear(bytes([200, 0, 0, 0, 1, 2, 3, 4, 1, 9]))
        if lose_store or wipe_data_dir:  # a replaced disk: the node restarts with an empty store
            self.disks[n] = MemoryDisk()
            self._ev("wipe", n, version=node.head.version)
        if wipe_data_dir:
            self.identity.discard(n)
        if cut_records:
            self._ev("cut", n, versions=cut_log(self.disks[n], cut_records))

    def crash_after_vote(self, n: str, methods: tuple[str, ...] = ("Consensus/Prepare", "Consensus/Accept"),
                         restart_after: float | None = None) -> None:
        """kill -9 of `n` right after its next granted promise or accept (of `methods`) has left, once: the
        proposer gets the vote, and `n` hears nothing after it (no commit), so that after a restart only
        its store remembers the vote. `restart_after`: seconds until it restarts (a supervisor), else never."""
        node = self.nodes[n]

        def handle(src: str, method: str, req: Any) -> Any:
            reply = node._handle(src, method, req)
            if method in methods and getattr(reply, "ok", False) and self.nodes.get(n) is node:
                self.net.transport(n).serve(node._handle, service="Consensus")  # once
                # runs once the reply is on the wire: it reaches the proposer, nothing later reaches `n`
                self.clock.call_later(0.0, lambda: self.crash(n) if self.nodes.get(n) is node else None)
                if restart_after is not None:
                    self.clock.call_later(restart_after, lambda: self.restart(n))
            return reply

        self.net.transport(n).serve(handle, service="Consensus")

    def isolate_after_commit(self, n: str) -> None:
        """Cut `n` off from every other node as soon as it next commits, once: the commits it sends then are
        lost on the wire (a partition drops messages in flight), and only the votes that chose it know."""
        node = self.nodes[n]
        armed = [True]

        def cut(c: pb.Commit, t: RoutingTable) -> None:
            if armed[0] and self.nodes.get(n) is node:
                armed[0] = False
                self.net.partition([[n], [m for m in self.ids if m != n]])

        node.on_commit(cut)

    def restart(self, n: str) -> None:
        if n not in self.down:
            return
        self.net.restart(n)
        self.down.discard(n)
        self.incarnation[n] += 1
        self._boot(n)
        self._ev("recover", n, versions=tuple(sorted(self.nodes[n].log.commits)), version=self.nodes[n].head.version)

    def propose(self, n: str, table: RoutingTable | None = None) -> int:
        node = self.nodes[n]
        t = table or successor_table(node.head, self.rng)
        self._ops += 1
        op = self._ops
        self._ev("invoke", n, version=t.version, parent=t.parent, digest=t.digest, op=op)

        def done(o: Outcome) -> None:
            res = "ok" if o.committed else ("fail" if "committed another table" in o.reason else "unknown")
            self.outcomes.append((n, o))
            self._ev("respond", n, version=t.version, digest=t.digest, result=res, op=op)

        node.propose(t, pb.Plan(), done)
        return op

    def run(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def heads(self) -> dict[str, int]:
        return {n: self.nodes[n].head.version for n in self.up()}


class RecordingStore(Store):
    """A Store that also records each durable accept (who accepted what at which ballot), so the checker
    can see what a quorum chose. `cluster` is any simulated cluster with an `_ev(kind, node, **fields)`.
    `durable(kind)`, when given, is told of each promise, accept and commit once it is durable (before the
    node replies or sends anything on): the hook that times faults to a version's steps."""

    def __init__(self, cluster: Any, node: str, disk: MemoryDisk, quorum: int,
                 durable: Callable[[str], None] | None = None) -> None:
        super().__init__(disk=disk)
        self.cluster, self.node, self.quorum, self.durable = cluster, node, quorum, durable

    def save_acceptor(self, state: pb.AcceptorState) -> None:
        super().save_acceptor(state)
        accepted = state.HasField("accepted") and state.accepted_ballot == state.promised
        if state.HasField("accepted"):
            b = (int(state.accepted_ballot.round), state.accepted_ballot.node_id)
            self.cluster._ev("accept", self.node, version=int(state.version), digest=state.accepted.table.content_hash,
                             ballot=b, quorum=self.quorum)
        if self.durable is not None and (accepted or state.HasField("promised")):
            self.durable("accept" if accepted else "promise")

    def append_commit(self, commit: pb.Commit, also: list[pb.AcceptorState] | None = None) -> None:
        super().append_commit(commit, also)
        if self.durable is not None:
            self.durable("commit")
