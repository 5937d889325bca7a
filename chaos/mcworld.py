"""The world chaos/modelcheck.py explores: real ConsensusNodes on a scheduler transport and clock.

Nothing happens on its own here. A call puts its request in flight; a reply goes in flight when the request is
delivered; a timer (the node's own, or a call's deadline) is armed until it is fired or cancelled. The explorer
picks the next event among `choices()`: deliver one message, fire one timer, crash, wipe or restart a node, or
a client's proposal. Time does not pass (`now()` is always 0.0): every order of timers is allowed, which is
more than real time allows (a safe verdict covers it; the rebuild argument's one timing assumption, an attempt
does not outlive a restart, is not assumed).

A message to a node that is down is lost if delivered while it is down, or it may wait and reach the restarted
node (a network may delay a message by any amount). A reply to a caller that stopped or whose call already
ended is a no-op forever, so it is dropped at once. Messages are never dropped otherwise: for the nodes'
states, a lost message is one never delivered.

`fingerprint()` is a canonical digest of everything that decides what can happen next (see chaos/mccanon.py);
`violations()` checks I1 against the history: the tables committed anywhere, those reported committed to a
client, and those a quorum of voters durably accepted at one ballot (at any time, not only at once).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from google.protobuf.message import Message

from agent.config import ConsensusConfig
from agent.consensus.node import ConsensusNode, Outcome
from agent.consensus.paxos import quorum_size
from agent.storage.store import MemoryDisk, Store
from agent.transport import HandlerTable, InvalidArgument, ReplyCallback, RequestHandler
from agent.transport.methods import lookup
from agent.transport.sim import PendingCall
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.v1 import consensus_pb2 as pb


class SchedTimer:
    """An armed timer: it runs only when the explorer fires it."""

    __slots__ = ("world", "node", "inc", "fn", "cancelled")

    def __init__(self, world: World, node: str, inc: int, fn: Callable[[], None]) -> None:
        self.world, self.node, self.inc, self.fn, self.cancelled = world, node, inc, fn, False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.world.timers.remove(self)


class SchedClock:
    def __init__(self, world: World, node: str, inc: int) -> None:
        self.world, self.node, self.inc = world, node, inc

    def now(self) -> float:
        return 0.0

    def call_later(self, delay: float, fn: Callable[[], None]) -> SchedTimer:
        t = SchedTimer(self.world, self.node, self.inc, fn)
        self.world.timers.append(t)
        return t


@dataclass
class Msg:
    """A request (src calls dst) or its reply (dst is the caller); `caller_inc`: the caller's incarnation."""

    reply: bool
    src: str
    caller_inc: int
    dst: str
    method: str
    data: bytes | None  # None: an error reply (the caller gets None)
    call: PendingCall


class SchedTransport:
    def __init__(self, world: World, node: str, inc: int) -> None:
        self.world, self.node, self.inc = world, node, inc

    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: ReplyCallback) -> None:
        if not self.world.is_current(self.node, self.inc):
            return
        c = PendingCall(on_reply)
        c.timer = SchedClock(self.world, self.node, self.inc).call_later(timeout, lambda: c.finish(None))
        self.world.msgs.append(Msg(False, self.node, self.inc, dst, method, request.SerializeToString(), c))

    def serve(self, handler: RequestHandler, service: str | None = None) -> None:
        self.world.handlers[self.node].set(handler, service)

    def add_peer(self, node_id: str, address: str) -> None:
        """Addresses mean nothing here."""

    async def close(self) -> None:
        """Nothing to release: no sockets."""


class RecordingStore(Store):
    """A Store that tells the world about each durable accept (who accepted which table at which ballot)."""

    def __init__(self, world: World, node: str, disk: MemoryDisk) -> None:
        super().__init__(disk=disk)
        self.world, self.node = world, node

    def save_acceptor(self, state: pb.AcceptorState) -> None:
        super().save_acceptor(state)
        if state.HasField("accepted"):
            key = (int(state.version), (int(state.accepted_ballot.round), state.accepted_ballot.node_id),
                   bytes(state.accepted.table.content_hash))
            self.world.votes.setdefault(key, set()).add(self.node)


@dataclass
class Bound:
    """The scenario: `voters` voters, versions up to `max_version`, at most `proposals` client proposals,
    `crashes` crashes (restart from the store) and `wipes` wiped data_dirs (restart with nothing)."""

    voters: int = 3
    max_version: int = 3
    proposals: int = 2
    crashes: int = 1
    wipes: int = 1
    thrifty_ms: int = 10
    max_attempts: int = 2
    fires: int = 3  # takeover, ballot retry/timeout and rebuild retry timers fired, in all
    call_timeouts: bool = False  # a call's deadline is a timer the explorer may fire
    founded: bool = False  # start once every founding member has decided (one order), not from the boot


@dataclass
class World:
    bound: Bound
    ids: list[str] = field(default_factory=list)
    nodes: dict[str, ConsensusNode] = field(default_factory=dict)
    disks: dict[str, MemoryDisk] = field(default_factory=dict)
    inc: dict[str, int] = field(default_factory=dict)
    up: set[str] = field(default_factory=set)
    had_store: dict[str, bool] = field(default_factory=dict)
    handlers: dict[str, HandlerTable] = field(default_factory=dict)
    msgs: list[Msg] = field(default_factory=list)
    timers: list[SchedTimer] = field(default_factory=list)
    crashes: int = 0
    wipes: int = 0
    proposals: int = 0
    fired: int = 0
    # history variables for I1
    votes: dict[tuple[int, tuple[int, str], bytes], set[str]] = field(default_factory=dict)
    installed: dict[int, set[bytes]] = field(default_factory=dict)
    reported: dict[int, set[bytes]] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        b = self.bound
        self.cfg = ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=0, thrifty_ms=b.thrifty_ms,
                                   max_attempts=b.max_attempts, log_compact_bytes=0)
        self.genesis = initial_table(Topology(1, 2, 4), 1, 2)
        self.ids = [f"n{i}" for i in range(b.voters)]
        self.quorum = quorum_size(len(self.ids))
        for n in self.ids:
            self.disks[n] = MemoryDisk()
            self.inc[n] = 0
            self.had_store[n] = False
            self.boot(n)
        if b.founded:
            self.found()

    def found(self) -> None:
        """Deliver messages oldest first until none is in flight (the founders hear from each other)."""
        while self.msgs:
            self.do("msg", 0)
        undecided = [n for n in self.ids if not getattr(self.nodes[n].rebuild, "decided", True)]
        if undecided:
            raise AssertionError(f"founders {undecided} still undecided with nothing in flight")

    # ---- nodes ------------------------------------------------------------------------------------
    def is_current(self, node: str, inc: int) -> bool:
        return node in self.up and self.inc[node] == inc

    def boot(self, n: str) -> None:
        inc = self.inc[n]
        self.handlers[n] = HandlerTable()
        node = ConsensusNode(n, self.ids, RecordingStore(self, n, self.disks[n]), SchedClock(self, n, inc),
                             SchedTransport(self, n, inc), self.cfg, self.genesis, rng=random.Random(inc),
                             live_voters=lambda: sorted(self.up),  # a failure detector that is never wrong
                             had_store=self.had_store[n], enrolment=zlib.crc32(f"{n}/{inc}".encode()) | 1)
        node.on_commit(self._installed)
        self.nodes[n] = node
        self.up.add(n)
        self.had_store[n] = True  # the data_dir's marker, written at the first start
        node.start()

    def _installed(self, c: pb.Commit, t: RoutingTable) -> None:
        self.installed.setdefault(t.version, set()).add(bytes(c.table.content_hash))

    def _done(self, o: Outcome) -> None:
        if o.committed and o.commit is not None:
            self.reported.setdefault(o.version, set()).add(bytes(o.commit.qc.table_hash))

    def stop(self, n: str, wipe: bool) -> None:
        node = self.nodes[n]
        self.conflicts += [f"{n}: {m}" for m in node.conflicts]
        self.up.discard(n)
        node.stop()
        self.inc[n] += 1
        self.timers = [t for t in self.timers if t.node != n]
        self.msgs = [m for m in self.msgs if not (m.reply and m.dst == n)]
        if wipe:  # the whole data_dir: the store and the marker that says the node ran before
            self.disks[n] = MemoryDisk()
            self.had_store[n] = False

    def proposal(self, n: str) -> RoutingTable:
        """A table for n's head + 1 that differs from every other proposal (the k-th spare slot gets a replica)."""
        head = self.nodes[n].head
        phy = head.phy2log.copy()
        free = [int(i) for i in np.flatnonzero(phy.ravel() < 0)]
        k = self.proposals
        if k >= len(free) * head.experts:
            raise ValueError(f"proposal {k}: only {len(free) * head.experts} distinct successors of v{head.version}")
        phy.ravel()[free[k // head.experts]] = k % head.experts
        return head.successor(phy)

    # ---- events -----------------------------------------------------------------------------------
    def choices(self) -> list[tuple[str, int | str]]:
        """Every event that may happen next: ("msg", i), ("timer", i), ("crash"|"wipe"|"restart"|"propose", n)."""
        b = self.bound
        out: list[tuple[str, int | str]] = [("msg", i) for i in range(len(self.msgs))]
        for i, t in enumerate(self.timers):
            kind = _timer_kind(t)
            if (kind in _BUDGETED and self.fired >= b.fires) or (kind == "deadline" and not b.call_timeouts):
                continue
            out.append(("timer", i))
        for n in self.ids:
            if n in self.up:
                if self.crashes < b.crashes:
                    out.append(("crash", n))
                if self.wipes < b.wipes:
                    out.append(("wipe", n))
                node = self.nodes[n]
                v = node.head.version + 1
                rb = node.rebuild
                refused = rb is not None and rb.decided and not rb.may_vote(node.head.version)  # UNAVAILABLE at once
                if self.proposals < b.proposals and v <= b.max_version and v not in node.proposer.pending \
                        and not refused and not any(t.version == v for _, t, _, _ in node.recovery.deferred):
                    out.append(("propose", n))
            else:
                out.append(("restart", n))
        return out

    def find(self, kind: str, what: str) -> tuple[str, int | str]:
        """The event ("msg", "src->dst Method") or (kind, node), to script a start: ("msg", "n2->n0 Accept") is
        the oldest Accept request in flight from n2 to n0 ("reply n0->n2 Accept": its reply)."""
        if kind != "msg":
            return kind, what
        reply = what.startswith("reply ")
        ends, method = what.removeprefix("reply ").split(" ")
        src, dst = ends.split("->")
        for i, m in enumerate(self.msgs):
            if (m.reply, m.src, m.dst, m.method) == (reply, src, dst, f"Consensus/{method}"):
                return "msg", i
        raise LookupError(f"no message {what!r} in flight")

    def do(self, kind: str, arg: int | str) -> str:
        """Run one event; returns a line for a trace."""
        if kind == "msg":
            m = self.msgs.pop(int(arg))
            return self._deliver(m)
        if kind == "timer":
            t = self.timers[int(arg)]
            what = _timer_name(t)
            if _timer_kind(t) in _BUDGETED:
                self.fired += 1
            t.cancel()
            t.fn()
            self.settle()
            return f"{t.node}: timer {what}"
        n = str(arg)
        if kind == "crash":
            self.crashes += 1
            self.stop(n, wipe=False)
            return f"crash {n}"
        if kind == "wipe":
            self.wipes += 1
            self.stop(n, wipe=True)
            return f"wipe {n} (store and data_dir lost)"
        if kind == "restart":
            what = "from its store" if self.disks[n].data else "from an empty store"
            self.boot(n)
            return f"restart {n} ({what})"
        if kind == "propose":
            table = self.proposal(n)
            self.proposals += 1
            self.nodes[n].propose(table, pb.Plan(), self._done)
            return f"{n}: propose v{table.version} table {table.digest.hex()[:6]}"
        raise ValueError(f"unknown event kind {kind!r}")

    def _deliver(self, m: Msg) -> str:
        req_cls, rep_cls = lookup(m.method)
        if m.reply:
            if self.is_current(m.dst, m.caller_inc) and not m.call.done:
                m.call.finish(None if m.data is None else rep_cls.FromString(m.data))
            self.settle()
            return f"{m.src}->{m.dst}: reply {m.method}{_brief(rep_cls, m.data)}"
        line = f"{m.src}->{m.dst}: {m.method}{_brief(req_cls, m.data)}"
        if m.dst not in self.up:
            return line + " (lost: node down)"
        handler = self.handlers[m.dst].get(m.method)
        data: bytes | None = None
        try:
            reply = handler(m.src, m.method, req_cls.FromString(m.data or b"")) if handler else None
        except InvalidArgument:
            reply = None
            self.msgs.append(Msg(True, m.dst, m.caller_inc, m.src, m.method, None, m.call))
        if isinstance(reply, Message):
            data = reply.SerializeToString()
            self.msgs.append(Msg(True, m.dst, m.caller_inc, m.src, m.method, data, m.call))
        self.settle()
        return line

    def settle(self) -> None:
        """Drop replies that can never matter (their caller stopped, or the call already ended)."""
        self.msgs = [m for m in self.msgs if not m.reply or (self.is_current(m.dst, m.caller_inc) and not m.call.done)]
        self.timers = [t for t in self.timers if self.is_current(t.node, t.inc)]

    # ---- I1 -----------------------------------------------------------------------------------------
    def violations(self) -> list[str]:
        out = list(self.conflicts)
        for n in self.up:
            out += [f"{n}: {c}" for c in self.nodes[n].conflicts]
        chosen: dict[int, set[bytes]] = {}
        for (v, _ballot, h), who in self.votes.items():
            if len(who & set(self.ids)) >= self.quorum:
                chosen.setdefault(v, set()).add(h)
        for v in sorted(set(chosen) | set(self.installed) | set(self.reported)):
            tables = chosen.get(v, set()) | self.installed.get(v, set()) | self.reported.get(v, set())
            if len(tables) > 1:
                out.append(f"I1: version {v}: {len(tables)} tables chosen/committed "
                           f"({', '.join(sorted(h.hex()[:6] for h in tables))})")
        return out


_BUDGETED = ("takeover", "attempt", "rebuild")


def _timer_kind(t: SchedTimer) -> str:
    """The node's name for an armed timer ("takeover", "attempt", "thrifty", "rebuild", ...), "deadline" for a
    call's, or the callback's name."""
    if t.fn.__qualname__.startswith("SchedTransport.call"):
        return "deadline"
    node = t.world.nodes.get(t.node)
    for key, armed in (node.timers.armed.items() if node is not None else ()):
        if armed is t:
            return key[0]
    return t.fn.__qualname__.rsplit(".", 1)[-1]


def _timer_name(t: SchedTimer) -> str:
    node = t.world.nodes.get(t.node)
    for key, armed in (node.timers.armed.items() if node is not None else ()):
        if armed is t:
            return f"{key[0]} v{key[1]}" if key[1] else key[0]
    return _timer_kind(t)


def _brief(cls: type[Message], data: bytes | None) -> str:
    if data is None:
        return " (error)"
    m = cls.FromString(data)
    bits = []
    for f in ("version", "ok", "committed_head", "knew_you", "rebuilding"):
        if f in m.DESCRIPTOR.fields_by_name and getattr(m, f):
            bits.append(f"{f}={getattr(m, f)}")
    for f in ("ballot", "promised"):
        if f in m.DESCRIPTOR.fields_by_name and m.HasField(f):
            bits.append(f"{f}=({getattr(m, f).round},{getattr(m, f).node_id})")
    if isinstance(m, pb.AcceptRequest):
        p = m.proposal
        bits.append(f"v{p.version} ballot=({p.ballot.round},{p.ballot.node_id}) table {p.table.content_hash.hex()[:6]}")
    if isinstance(m, pb.Commit):
        bits.append(f"v{m.table.version} table {m.table.content_hash.hex()[:6]}")
    return f" [{' '.join(bits)}]" if bits else ""
