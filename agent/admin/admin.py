"""The Admin gRPC service behind the `emoe` CLI.

Reads come from the node's state; mutating calls go through the node (estimate-verify-commit, quorum).
Bad input gets INVALID_ARGUMENT with the reason and changes nothing.
"""

from __future__ import annotations

import asyncio
import ipaddress
from typing import Any, NoReturn, Protocol
from urllib.parse import unquote

import grpc
import numpy as np
import numpy.typing as npt

from agent.admin.answer import ANSWER_KEY, NOT_SERVING
from agent.consensus.control import MAX_ADMIN
from agent.security import peer_identity
from agent.wire import WireError, ops_from_pb
from controlplane.ops import Operation
from controlplane.table import RoutingTable, copied_slots
from elasticmoe.codec import table_to_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb

# Per-call bounds on Propose, checked before anything that scales with the request: a manual proposal is
# a handful of operations (ESFT intent from static EP needs ~250 over 26 layers; decision.max_ops defaults
# to 512). Without them one call of 1,000,000 operations held the event loop for seconds (peers declared
# the node dead). The agent's gRPC limit (64 MiB, for consensus catch-up) is far above any admin request.
MAX_PROPOSE_OPS = 4096
MAX_PROPOSE_EXPERTS = 65536     # expert ids over all operations (a consolidate lists several)
MAX_PROPOSE_BYTES = 1 << 20     # encoded request size
# above this many operations, decoding and checking them runs in a worker thread, not on the event loop
OFFLOAD_OPS = 64
# gRPC metadata of Pause and Resume in plaintext: the admin the CLI says it is (nobody checks it; under mTLS the
# admin certificate's CN is taken instead and this is ignored)
ADMIN_KEY = "emoe-admin"


class AdminReads(Protocol):
    """What the admin service reads of the node (agent.admin.adminview.AdminView)."""

    node_id: str

    def head(self) -> RoutingTable: ...
    def table_at(self, version: int) -> RoutingTable | None: ...
    def member_states(self) -> list[gpb.MemberState]: ...
    def peer_versions(self) -> dict[str, int]: ...
    def health(self) -> str: ...
    def role(self) -> str: ...
    def window_seq(self) -> int: ...
    def imbalance_history(self) -> list[float]: ...
    def cluster_load(self) -> np.ndarray | None: ...
    def commits(self, limit: int) -> list[cpb.Commit]: ...
    def explain(self, version: int) -> apb.ExplainReply | None: ...
    def ranks_per_node(self) -> int: ...
    def rank_installs(self) -> list[apb.RankInstall]: ...
    def install_lag_bound_s(self) -> float: ...
    def paused(self) -> bool: ...
    def pause_record(self) -> cpb.ControlCommit | None: ...
    def planner(self) -> str: ...
    def fingerprint(self) -> gpb.Fingerprint: ...
    def fingerprint_mismatches(self) -> list[apb.FingerprintMismatch]: ...
    def expert_bytes(self) -> int: ...
    def window_steps(self) -> int: ...


class AdminSteering(Protocol):
    """How the admin service steers the node (agent.decision.manual.ManualPath)."""

    async def set_paused(self, paused: bool, admin: str) -> apb.AdminAck: ...
    async def propose_manual(self, ops: tuple[Operation, ...], force: bool) -> apb.ProposeReply: ...
    async def drain(self, rank: int) -> apb.AdminAck: ...
    async def restore(self, rank: int) -> apb.AdminAck: ...


async def _fail(context: grpc.aio.ServicerContext, code: grpc.StatusCode, reason: str) -> NoReturn:
    await context.abort(code, reason)
    raise RuntimeError("unreachable: context.abort raises")


async def _not_serving(context: grpc.aio.ServicerContext, reason: str) -> NoReturn:
    """UNAVAILABLE as the agent's own answer (agent.admin.answer: the CLI tells it from the transport's by code)."""
    context.set_trailing_metadata(((ANSWER_KEY, NOT_SERVING),))
    await _fail(context, grpc.StatusCode.UNAVAILABLE, reason)


def unknown_ids(head: RoutingTable, ops: tuple[Operation, ...]) -> str:
    """Which operation names a layer, expert or rank the committed table does not have, or ""."""
    bounds = {"layer": (0, head.layers), "expert": (0, head.experts), "experts": (0, head.experts),
              "src": (0, head.topology.ranks), "dst": (0, head.topology.ranks), "rank": (0, head.topology.ranks),
              "source": (-1, head.topology.ranks)}
    for i, op in enumerate(ops):
        for name, (lo, hi) in bounds.items():
            value = getattr(op, name, None)
            for x in value if isinstance(value, tuple) else () if value is None else (value,):
                if not lo <= x < hi:
                    return f"ops[{i}].{name} = {x}: expected {lo}..{hi - 1} (unknown {name.rstrip('s')})"
    return ""


def rank_nodes(members: list[gpb.MemberState], ranks: int) -> list[str]:
    """The node id of each of `ranks` global ranks by the members' own rank lists ("" where none holds it; a
    rank two members claim goes to the first by node id)."""
    out = [""] * ranks
    for m in sorted(members, key=lambda m: m.node_id, reverse=True):
        for g in m.ranks:
            if 0 <= g < ranks:
                out[g] = m.node_id
    return out


def copy_bytes(parent: npt.ArrayLike | None, commit: cpb.Commit, expert_bytes: int) -> int:
    """Weight bytes `commit` copies over its parent's phy2log `parent` (0 without it, or of another size)."""
    b = np.frombuffer(commit.table.phy2log, dtype="<i8")
    a = None if parent is None else np.asarray(parent).reshape(-1)
    if a is None or a.shape != b.shape:
        return 0
    return copied_slots(a, b) * expert_bytes


def propose_bounds(request: apb.ProposeRequest) -> str:
    """Why `request` is over the per-call bounds, or "". Costs O(1) per operation in C, before any decoding."""
    n = len(request.ops)
    if n > MAX_PROPOSE_OPS:
        return f"ops: {n} operations: expected at most {MAX_PROPOSE_OPS} per Propose (propose in several steps)"
    size = request.ByteSize()
    if size > MAX_PROPOSE_BYTES:
        return f"request of {size} bytes: expected at most {MAX_PROPOSE_BYTES} per Propose"
    experts = sum(len(o.experts) for o in request.ops)
    if experts > MAX_PROPOSE_EXPERTS:
        return f"ops: {experts} expert ids in all: expected at most {MAX_PROPOSE_EXPERTS} per Propose"
    return ""


def _decode_and_check(request: apb.ProposeRequest, head: RoutingTable) -> tuple[tuple[Operation, ...], str]:
    """The request's operations, and why they cannot be proposed against `head` (or "")."""
    try:
        ops = ops_from_pb(request.ops)
    except WireError as e:
        return (), str(e)
    if not ops:
        return (), "ops is empty: expected at least one operation"
    return ops, unknown_ids(head, ops)


def is_local_peer(peer: str) -> bool:
    """Whether a gRPC peer ('ipv4:127.0.0.1:5000', 'ipv6:%5B::1%5D:5000', 'unix:/run/x.sock') is on this host."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    host = unquote(rest).rpartition(":")[0].strip("[]")  # gRPC writes ipv6:%5B::1%5D:port
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return kind in ("ipv4", "ipv6") and (ip.is_loopback or (mapped is not None and mapped.is_loopback))


async def local_callers_only(context: grpc.aio.ServicerContext) -> None:
    """An `authorize` for an agent without TLS: no caller has a verified identity, so mutating calls are
    accepted only from this host (loopback or a unix socket); others get PERMISSION_DENIED with the reason.
    With TLS, `agent.security.AuthzInterceptor` requires an admin certificate instead."""
    peer = context.peer()
    if not is_local_peer(peer):
        await _fail(context, grpc.StatusCode.PERMISSION_DENIED,
                    f"caller {peer}: without TLS, mutating admin calls are accepted only from this host; "
                    f"set [tls] cert_dir to administer the agent remotely")


class AdminService(admin_pb2_grpc.AdminServicer):
    """Registered before the gRPC server starts (the node's consensus must be served while it recovers), and
    bound to the node's read and steering parts once the node has started (`bind`); until then every call
    answers UNAVAILABLE."""

    def __init__(self, node_id: str, authorize: Any = None) -> None:
        self.node_id = node_id
        self._reads: AdminReads | None = None
        self._steer: AdminSteering | None = None
        # authorize(context) aborts with PERMISSION_DENIED for a caller not allowed to mutate (mTLS identity)
        self._authorize = authorize

    def bind(self, reads: AdminReads, steer: AdminSteering) -> None:
        self._reads, self._steer = reads, steer

    @classmethod
    def over(cls, node: Any, authorize: Any = None) -> AdminService:
        """A service bound at once to one object that both reads and steers (tests, fuzzing)."""
        svc = cls(node.node_id, authorize)
        svc.bind(node, node)
        return svc

    async def _view(self, context: grpc.aio.ServicerContext) -> AdminReads:
        if self._reads is None:
            await _not_serving(context, f"agent {self.node_id} is STARTING")
        return self._reads

    async def _mutating(self, context: grpc.aio.ServicerContext) -> AdminSteering:
        if self._authorize is not None:
            await self._authorize(context)
        view = await self._view(context)
        if view.health() != "SERVING" or self._steer is None:
            await _not_serving(context, f"agent {self.node_id} is {view.health()}")
        return self._steer

    async def Status(self, request: apb.StatusRequest, context: grpc.aio.ServicerContext) -> apb.StatusReply:
        view = await self._view(context)
        hist = view.imbalance_history()
        return apb.StatusReply(
            node_id=self.node_id, committed_version=view.head().version,
            members=view.member_states(), paused=view.paused(), health=view.health(),
            step_imbalance=hist[-1] if hist else 0.0, window_seq=view.window_seq(),
            peer_versions=view.peer_versions(), role=view.role(), ranks=view.rank_installs(),
            install_lag_bound_s=view.install_lag_bound_s(), pause=view.pause_record(), planner=view.planner(),
            fingerprint=view.fingerprint(), fingerprint_mismatches=view.fingerprint_mismatches(),
        )

    async def Placement(self, request: apb.PlacementRequest, context: grpc.aio.ServicerContext) -> apb.PlacementReply:
        view = await self._view(context)
        head = view.head()
        table = head if request.version in (0, head.version) else view.table_at(request.version)
        if table is None:
            await _fail(context, grpc.StatusCode.NOT_FOUND,
                                f"version {request.version} unknown: committed versions are 1..{head.version}")
        if not -1 <= request.layer < table.layers:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                                f"layer {request.layer}: expected -1 (all) or 0..{table.layers - 1}")
        load = view.cluster_load()
        raw = b"" if load is None else np.asarray(load, dtype="<u4").tobytes()
        return apb.PlacementReply(table=table_to_pb(table), ranks_per_node=view.ranks_per_node(),
                                  expert_load=raw, rank_nodes=rank_nodes(view.member_states(), table.topology.ranks))

    async def History(self, request: apb.HistoryRequest, context: grpc.aio.ServicerContext) -> apb.HistoryReply:
        view = await self._view(context)
        limit = request.limit or 20
        commits = view.commits(limit)  # newest first
        size = view.expert_bytes()
        entries = []
        for i, c in enumerate(commits):
            older = commits[i + 1] if i + 1 < len(commits) else None
            if older is not None and older.table.version == c.table.parent:
                parent: npt.NDArray[np.int64] | None = np.frombuffer(older.table.phy2log, dtype="<i8")
            else:  # the oldest shown: its parent from the agent (the genesis table has no commit record)
                t = view.table_at(int(c.table.parent)) if c.table.parent else None
                parent = None if t is None else t.phy2log
            entries.append(apb.HistoryEntry(
                version=c.table.version, parent=c.table.parent, plan=c.plan, votes=c.votes, proposer=c.proposer,
                committed_at_ms=c.committed_at_ms, committed_at_unix_ms=c.plan.proposed_at_unix_ms,
                copy_bytes=copy_bytes(parent, c, size)))
        return apb.HistoryReply(entries=entries)

    async def Explain(self, request: apb.ExplainRequest, context: grpc.aio.ServicerContext) -> apb.ExplainReply:
        view = await self._view(context)
        r = view.explain(request.version)
        if r is None:
            head = view.head().version
            if request.version == 0:
                why = ("no load has arrived from an engine's shim; the planner decides when a load window "
                       "closes" if view.cluster_load() is None else
                       f"the planner has not decided since this agent started (load window {view.window_seq()})")
                await _fail(context, grpc.StatusCode.NOT_FOUND,
                            f"no decision yet on agent {self.node_id} (head is version {head}): {why}")
            await _fail(context, grpc.StatusCode.NOT_FOUND,
                                f"no decision recorded for version {request.version} (head is {head})")
        return r

    async def LoadView(self, request: apb.LoadViewRequest, context: grpc.aio.ServicerContext) -> apb.LoadViewReply:
        view = await self._view(context)
        from controlplane.load import rank_load

        head = view.head()
        load = view.cluster_load()
        hist = view.imbalance_history()
        if load is None:
            return apb.LoadViewReply(layers=head.layers, experts=head.experts, imbalance_history=hist[-60:],
                                     window=view.window_steps(), window_seq=view.window_seq())
        ranks = rank_load(head, load.astype(np.int64)).sum(axis=0)
        return apb.LoadViewReply(
            layers=head.layers, experts=head.experts, counts=np.asarray(load, dtype="<u4").tobytes(),
            rank_load=ranks.astype("<u8").tobytes(), step_imbalance=hist[-1] if hist else 0.0,
            imbalance_history=hist[-60:], window=view.window_steps(), window_seq=view.window_seq(),
        )

    async def Propose(self, request: apb.ProposeRequest, context: grpc.aio.ServicerContext) -> apb.ProposeReply:
        steer = await self._mutating(context)
        view = await self._view(context)
        too_big = propose_bounds(request)
        if too_big:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, too_big)
        head = view.head()
        if len(request.ops) > OFFLOAD_OPS:
            ops, bad = await asyncio.to_thread(_decode_and_check, request, head)
        else:
            ops, bad = _decode_and_check(request, head)
        if bad:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, bad)
        return await steer.propose_manual(ops, request.force)

    async def Drain(self, request: apb.RankRequest, context: grpc.aio.ServicerContext) -> apb.AdminAck:
        steer = await self._mutating(context)
        await self._check_rank(request.rank, context)
        return await steer.drain(request.rank)

    async def Restore(self, request: apb.RankRequest, context: grpc.aio.ServicerContext) -> apb.AdminAck:
        steer = await self._mutating(context)
        await self._check_rank(request.rank, context)
        return await steer.restore(request.rank)

    async def Pause(self, request: apb.Empty, context: grpc.aio.ServicerContext) -> apb.AdminAck:
        """Commit a pause record by quorum (agent/consensus/control.py): every node stops planning rebalances. The
        record names the admin who asked (`_admin`) and this node, which admitted the call."""
        steer = await self._mutating(context)
        return await steer.set_paused(True, await self._admin(context))

    async def Resume(self, request: apb.Empty, context: grpc.aio.ServicerContext) -> apb.AdminAck:
        steer = await self._mutating(context)
        return await steer.set_paused(False, await self._admin(context))

    @staticmethod
    async def _admin(context: grpc.aio.ServicerContext) -> str:
        """Who asked: under mTLS the CN of the admin certificate the TLS handshake verified (the authorization
        checked it is an admin); in plaintext what the caller's `emoe-admin` metadata says ("" when none),
        unchecked: plaintext has no identities."""
        cn = peer_identity(context)
        if cn is not None:
            return cn
        raw = next((v for k, v in context.invocation_metadata() or () if k == ADMIN_KEY), "")
        said = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        if len(said) > MAX_ADMIN or not said.isprintable():
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"metadata {ADMIN_KEY} = {said[:64]!r}: expected at most {MAX_ADMIN} printable characters")
        return said

    async def _check_rank(self, rank: int, context: grpc.aio.ServicerContext) -> None:
        G = (await self._view(context)).head().topology.ranks
        if not 0 <= rank < G:
            await _fail(context, grpc.StatusCode.INVALID_ARGUMENT, f"rank {rank}: expected 0..{G - 1}")
