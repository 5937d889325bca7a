"""The RPC handlers the fuzzer drives, each wrapped as a `Target`: fresh state, valid seed requests, a
snapshot of everything a request could change, and one call that returns a `Verdict`.

A handler refuses hostile input in one of three typed ways, all counted as a rejection: a reply with
ok=False and a reason (consensus), an abort with INVALID_ARGUMENT / PERMISSION_DENIED / NOT_FOUND and the
reason (gRPC servicers), or a typed exception (`InvalidArgument`, the shim's `ShimError`). Anything else
that escapes is a crash.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import Message

from agent.clock import FakeClock
from agent.config import ConsensusConfig
from agent.consensus.control import MAX_SEQ_STEP, check_commit, check_record
from agent.consensus.node import ConsensusNode
from agent.consensus.paxos import round0_owner
from agent.storage.store import MemoryDisk, Store
from agent.transport import InvalidArgument
from chaos.quorumsim import successor_table
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology
from elasticmoe.codec import table_to_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as pb
from elasticmoe.v1 import gossip_pb2 as gpb

TOPO = Topology(nodes=2, ranks_per_node=2, slots_per_rank=4)
LAYERS, EXPERTS = 2, 8
VOTERS = ["a", "b", "c"]
REFUSAL_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
                           grpc.StatusCode.NOT_FOUND})


@dataclass(frozen=True)
class Verdict:
    rejected: bool
    reason: str = ""
    read_only: bool = False  # a query: must change nothing even when it answers


class Target:
    """One RPC handler under fuzzing. Subclasses set `name` and `request` and implement the four hooks."""

    name: str = ""
    request: type[Message] = Message

    def seeds(self) -> list[Message]:
        raise NotImplementedError

    def fresh(self) -> None:
        """Reset to the known starting state (after an accepted request changed it)."""
        raise NotImplementedError

    def snapshot(self) -> Hashable:
        raise NotImplementedError

    def call(self, req: Message) -> Verdict:
        raise NotImplementedError

    def must_refuse(self, req: Message) -> str:
        """An independent oracle: why `req` is plainly hostile and must be refused, or "" (no opinion)."""
        return ""

    def close(self) -> None:
        pass


# ---- fixtures shared by the targets and the tests ---------------------------------------------------
def genesis() -> RoutingTable:
    return initial_table(TOPO, LAYERS, EXPERTS)


def chain(n: int, seed: int = 7) -> list[RoutingTable]:
    """Versions 1..n: genesis and n - 1 valid successors."""
    rng = random.Random(seed)
    out = [genesis()]
    while len(out) < n:
        out.append(successor_table(out[-1], rng))
    return out


def certify(t: RoutingTable, voters: list[str] | None = None, quorum: int = 2, rnd: int = 1,
            proposer: str = "b") -> pb.Commit:
    qc = pb.QuorumCertificate(version=t.version, ballot=pb.Ballot(round=rnd, node_id=proposer),
                              table_hash=t.digest, voters=voters if voters is not None else ["a", "b"],
                              quorum=quorum)
    return pb.Commit(table=table_to_pb(t), qc=qc, plan=pb.Plan(trigger="test"), proposer=proposer,
                     votes=[pb.Vote(voter=v, accept=True) for v in qc.voters])


class NullTransport:
    """Records outgoing calls; never replies (a handler's side effects stay inside the node)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []
        self.handlers: dict[str | None, Any] = {}

    def call(self, dst: str, method: str, request: Message, timeout: float, on_reply: Any) -> None:
        self.sent.append((dst, method))

    def serve(self, handler: Any, service: str | None = None) -> None:
        self.handlers[service] = handler

    def add_peer(self, node_id: str, address: str) -> None:
        pass

    async def close(self) -> None:
        """Nothing to release: no sockets."""


def _ser(m: Message) -> bytes:
    return m.SerializeToString(deterministic=True)


# ---- consensus ---------------------------------------------------------------------------------------
class ConsensusTarget(Target):
    """Node "a" of voters a, b, c with versions 1..3 committed; requests arrive from "b"."""

    TABLES = chain(5)

    def __init__(self, method: str, src: str = "b") -> None:
        self.method, self.src = method, src
        self.name = f"Consensus/{method}"
        self.request = {"Prepare": pb.PrepareRequest, "Accept": pb.AcceptRequest, "Learn": pb.Commit,
                        "CatchUp": pb.CatchUpRequest, "ControlAccept": pb.ControlAcceptRequest,
                        "ControlLearn": pb.ControlCommit}[method]
        base = Store(disk=(disk := MemoryDisk()))
        base.open()
        for t in self.TABLES[1:3]:
            base.append_commit(certify(t))
        self._base_disk = bytes(disk.data)
        self.fresh()

    def fresh(self) -> None:
        if round0_owner(4, VOTERS) != "b":
            raise RuntimeError("fixture: the seeds assume b owns round 0 of version 4")
        self.disk = MemoryDisk()
        self.disk.data += self._base_disk
        self.transport = NullTransport()
        cfg = ConsensusConfig(accept_timeout_ms=50, sync_interval_ms=0)
        self.node = ConsensusNode("a", VOTERS, Store(disk=self.disk), FakeClock(), self.transport, cfg, genesis())
        self.node.start()

    def seeds(self) -> list[Message]:
        t = self.TABLES
        v4 = t[3]
        if self.method == "Prepare":
            return [pb.PrepareRequest(version=v, ballot=pb.Ballot(round=r, node_id="b"), from_node="b")
                    for v, r in ((4, 1), (4, 7), (5, 2))]
        if self.method == "Accept":
            plan = pb.Plan(ops=[pb.Operation(kind=pb.REPLICATE, layer=0, experts=[1], dst=2, src=-1, rank=-1,
                                             source=-1)], estimated_gain=0.1, verified_gain=0.0, trigger="fuzz")
            out = []
            for b in (pb.Ballot(round=0, node_id="b"), pb.Ballot(round=1, node_id="b")):  # b owns round 0 of 4
                p = pb.Proposal(version=4, ballot=b, table=table_to_pb(v4), plan=plan, proposer=b.node_id)
                out.append(pb.AcceptRequest(proposal=p, from_node=b.node_id))
            return out
        if self.method == "Learn":
            return [certify(v4), certify(t[4]), certify(t[2]), certify(v4, ["a", "b", "c"])]
        if self.method == "ControlAccept":
            return [pb.ControlAcceptRequest(record=pb.ControlRecord(seq=s, node_id=n, paused=True, at_ms=1, note="x"),
                                            from_node="b") for s, n in ((1, "b"), (2, "c"), (70000, "b"))]
        if self.method == "ControlLearn":
            r = pb.ControlRecord(seq=3, node_id="c", paused=True, at_ms=1)
            return [pb.ControlCommit(record=r, voters=vs, quorum=2) for vs in (["b", "c"], ["a", "b", "c"], ["c"])]
        return [pb.CatchUpRequest(from_version=v, from_node="b", limit=lim) for v, lim in ((1, 2), (0, 0), (3, 9))]

    def snapshot(self) -> Hashable:
        n = self.node
        return (n.log.head.version, n.log.head.digest,
                tuple((v, _ser(c)) for v, c in sorted(n.log.commits.items())),
                tuple((v, _ser(c)) for v, c in sorted(n.log.future.items())),
                tuple((v, _ser(s)) for v, s in sorted(n.acceptor.states.items())),
                bytes(self.disk.data), tuple(n.log.conflicts), _ser(n.control.acceptor.state()))

    def must_refuse(self, req: Message) -> str:
        head = self.node.head.version
        if isinstance(req, (pb.PrepareRequest, pb.AcceptRequest)):
            b = req.ballot if isinstance(req, pb.PrepareRequest) else req.proposal.ballot
            if b.node_id != self.src:
                return "a ballot that is not the sender's"
        if isinstance(req, pb.PrepareRequest):
            if req.version <= head or req.ballot.round == 0 or req.ballot.round > 2**62:
                return "prepare for a committed version, at round 0, or at an overflowing round"
        if isinstance(req, pb.AcceptRequest):
            p = req.proposal
            if not all(math.isfinite(x) for x in (p.plan.estimated_gain, p.plan.verified_gain, p.plan.cost)):
                return "non-finite plan number"
            if (p.table.layers, p.table.experts) != (LAYERS, EXPERTS) or p.version != head + 1:
                return "wrong shape or not the next version"
        if isinstance(req, pb.ControlAcceptRequest) and check_record(req.record):
            return "a malformed control record"
        if isinstance(req, pb.ControlAcceptRequest) and req.record.seq > MAX_SEQ_STEP:  # (nothing held here yet)
            return "a control record's seq far above any held"
        if isinstance(req, pb.ControlCommit) and check_commit(req, VOTERS):
            return "a control certificate with non-voters, too few voters, or a wrong quorum"
        if isinstance(req, pb.Commit) and req.table.version > head:
            if set(req.qc.voters) - set(VOTERS) or len(set(req.qc.voters)) < 2 or req.qc.quorum != 2:
                return "certificate with non-voters, too few voters, or a wrong quorum"
            if (req.table.layers, req.table.experts) != (LAYERS, EXPERTS):
                return "wrong shape"
        return ""

    def call(self, req: Message) -> Verdict:
        try:
            reply = self.node._handle(self.src, self.name, req)
        except InvalidArgument as e:
            return Verdict(True, str(e))
        if self.method == "CatchUp":
            if not isinstance(reply, pb.CatchUpReply):
                raise TypeError(f"CatchUp answered {type(reply).__name__}")
            # a query, except an enrolment (agent/consensus/rebuild.py): the sender, a voter, is recorded durably
            return Verdict(False, read_only=not (isinstance(req, pb.CatchUpRequest) and req.enrolment))
        ok = getattr(reply, "ok", None)
        if ok is None:
            raise TypeError(f"{self.name} answered {type(reply).__name__}: expected a typed reply")
        return Verdict(not ok, reply.reason)


# ---- admin -------------------------------------------------------------------------------------------
class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """Enough of grpc.aio.ServicerContext for a servicer: abort raises, identity from a CN."""

    def __init__(self, identity: str | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.identity, self.metadata = identity, metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise Aborted(code, details)

    def auth_context(self) -> dict[str, list[bytes]]:
        return {} if self.identity is None else {"x509_common_name": [self.identity.encode()]}

    def peer_identities(self) -> list[bytes] | None:
        return None if self.identity is None else [self.identity.encode()]

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


class FakeAdminBackend:
    """The admin service's reads and steering (agent.admin.admin.AdminReads, AdminSteering) in one object; records every mutation the service passes on (and changes nothing else)."""

    def __init__(self, tables: list[RoutingTable] | None = None) -> None:
        self.tables = tables or chain(3)
        self.node_id = "a"
        self.switch = False  # the pause switch as Pause and Resume left it
        self.admin = ""  # the admin the last Pause or Resume named
        self.mutations: list[tuple[Any, ...]] = []
        self.load = np.arange(LAYERS * EXPERTS, dtype=np.uint32).reshape(LAYERS, EXPERTS)

    def head(self) -> RoutingTable:
        return self.tables[-1]

    def table_at(self, version: int) -> RoutingTable | None:
        return next((t for t in self.tables if t.version == version), None)

    def member_states(self) -> list[Any]:
        return []

    def peer_versions(self) -> dict[str, int]:
        return {"a": self.head().version}

    def health(self) -> str:
        return "SERVING"

    def role(self) -> str:
        return "voter"

    def window_seq(self) -> int:
        return 3

    def imbalance_history(self) -> list[float]:
        return [1.5, 1.25]

    def cluster_load(self) -> np.ndarray:
        return self.load

    def commits(self, limit: int) -> list[pb.Commit]:
        return [certify(t) for t in reversed(self.tables[1:])][:limit]

    def explain(self, version: int) -> apb.ExplainReply | None:
        return apb.ExplainReply(version=version, outcome="committed") if self.table_at(version) else None

    def ranks_per_node(self) -> int:
        return TOPO.ranks_per_node

    def rank_installs(self) -> list[apb.RankInstall]:
        return [apb.RankInstall(rank=0, installed_version=self.head().version, active=True, attached=True)]

    def install_lag_bound_s(self) -> float:
        return 5.0

    def paused(self) -> bool:
        return self.switch

    def pause_record(self) -> pb.ControlCommit | None:
        return pb.ControlCommit(record=pb.ControlRecord(seq=1, node_id="a", paused=self.switch), voters=["a"], quorum=1)

    def planner(self) -> str:
        return "a"

    def fingerprint(self) -> gpb.Fingerprint:
        return gpb.Fingerprint(nodes=2, ranks_per_node=2, slots_per_rank=4, layers=LAYERS, experts=EXPERTS, top_k=2)

    def fingerprint_mismatches(self) -> list[apb.FingerprintMismatch]:
        return []

    async def set_paused(self, paused: bool, admin: str) -> apb.AdminAck:
        self.switch = paused
        self.admin = admin  # who the service said asked
        return apb.AdminAck(ok=True, version=self.head().version)

    def expert_bytes(self) -> int:
        return 1 << 20

    def window_steps(self) -> int:
        return 100

    async def propose_manual(self, ops: tuple[Any, ...], force: bool) -> apb.ProposeReply:
        self.mutations.append(("propose", ops, force))
        return apb.ProposeReply(committed=True, version=self.head().version + 1)

    async def drain(self, rank: int) -> apb.AdminAck:
        self.mutations.append(("drain", rank))
        return apb.AdminAck(ok=True, version=self.head().version + 1)

    async def restore(self, rank: int) -> apb.AdminAck:
        self.mutations.append(("restore", rank))
        return apb.AdminAck(ok=True, version=self.head().version + 1)


ADMIN_METHODS = {m.name: m.input_type.name for m in apb.DESCRIPTOR.services_by_name["Admin"].methods}
_ADMIN_SEEDS: dict[str, Callable[[], list[Message]]] = {
    "Placement": lambda: [apb.PlacementRequest(layer=-1), apb.PlacementRequest(layer=1, version=2)],
    "History": lambda: [apb.HistoryRequest(limit=2)],
    "Explain": lambda: [apb.ExplainRequest(version=2)],
    "Propose": lambda: [apb.ProposeRequest(ops=[pb.Operation(kind=pb.REPLICATE, layer=0, experts=[1], dst=2,
                                                             src=-1, rank=-1, source=-1)]),
                        apb.ProposeRequest(ops=[pb.Operation(kind=pb.MIGRATE, layer=1, experts=[0], src=0, dst=3,
                                                             rank=-1, source=-1)], force=True)],
    "Drain": lambda: [apb.RankRequest(rank=1)],
    "Restore": lambda: [apb.RankRequest(rank=3)],
}


class AdminTarget(Target):
    def __init__(self, method: str, loop: asyncio.AbstractEventLoop, identity: str | None = None,
                 authorize: Any = None) -> None:
        from agent.admin.admin import AdminService

        self.method, self.loop, self.identity = method, loop, identity
        self.name = f"Admin/{method}"
        self.request = getattr(apb, ADMIN_METHODS[method])
        self._make = lambda: AdminService.over(self.backend, authorize=authorize)
        self.fresh()

    def fresh(self) -> None:
        self.backend = FakeAdminBackend()
        self.service = self._make()

    def seeds(self) -> list[Message]:
        return _ADMIN_SEEDS.get(self.method, lambda: [self.request()])()

    def snapshot(self) -> Hashable:
        return (repr(self.backend.mutations), self.backend.switch)

    def must_refuse(self, req: Message) -> str:
        if self.method in ("Drain", "Restore") and not 0 <= req.rank < TOPO.ranks:  # type: ignore[attr-defined]
            return "unknown rank"
        if self.method == "Placement" and not -1 <= req.layer < LAYERS:  # type: ignore[attr-defined]
            return "unknown layer"
        if self.method == "Propose" and not req.ops:  # type: ignore[attr-defined]
            return "no operations"
        return ""

    def call(self, req: Message) -> Verdict:
        coro = getattr(self.service, self.method)(req, FakeContext(self.identity))
        try:
            self.loop.run_until_complete(coro)
        except Aborted as e:
            if e.code not in REFUSAL_CODES:
                raise
            return Verdict(True, e.details)
        return Verdict(False, read_only=self.method in ("Status", "Placement", "History", "Explain", "LoadView"))
