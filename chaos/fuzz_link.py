"""Fuzz targets for the local link: the agent's DataplaneLink servicer (ReportLoad into LocalWindows, as
NodeState does; WatchTables) and the shim's TableStore.offer_commit."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import numpy as np
from google.protobuf.message import Message

from chaos.fuzz_targets import (
    EXPERTS,
    LAYERS,
    REFUSAL_CODES,
    TOPO,
    VOTERS,
    Aborted,
    FakeContext,
    Target,
    Verdict,
    _ser,
    certify,
    chain,
)
from elasticmoe.v1 import consensus_pb2 as pb
from elasticmoe.v1 import dataplane_pb2 as dpb


# ---- the local link (agent side) and the shim's table store ---------------------------------------------
class _EndOfStream(Exception):
    pass


class _Source:
    def __init__(self, commits: list[pb.Commit]) -> None:
        self.commits = commits

    def head_version(self) -> int:
        return max((c.table.version for c in self.commits), default=1)

    def commits_since(self, version: int) -> list[pb.Commit]:
        return [c for c in self.commits if c.table.version > version]

    async def wait_for_newer(self, version: int) -> None:
        raise _EndOfStream


RANKS = (0, 1)  # the target node's ranks (TOPO's first node)


class LinkTarget(Target):
    """The agent's DataplaneLink servicer: ReportLoad into LocalWindows past the node's ReportGuard (as NodeState
    does: agent.link.loadpath), WatchTables."""

    def __init__(self, method: str, loop: asyncio.AbstractEventLoop) -> None:
        self.method, self.loop = method, loop
        self.name = f"DataplaneLink/{method}"
        self.request = dpb.LoadReport if method == "ReportLoad" else dpb.WatchTablesRequest
        self.commits = [certify(t) for t in chain(3)[1:]]
        self.fresh()

    def fresh(self) -> None:
        from agent.link.loadpath import LoadReportError, LocalWindows
        from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
        from agent.link.shim_link import DataplaneLinkServicer

        self.windows = LocalWindows(LAYERS, EXPERTS, window=10)
        self.delivered: list[bytes] = []
        head = max(c.table.version for c in self.commits)
        self.guard = ReportGuard(RANKS, TOPO.ranks, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: head)

        def sink(r: dpb.LoadReport) -> None:
            refused = self.guard.check(r)
            if refused is not None:
                raise LoadReportError(str(refused))
            counts = np.frombuffer(r.counts, dtype="<u4").reshape(r.layers, r.experts)
            self.windows.add(r.shim_id or f"rank{r.rank}", r.first_step, r.steps, counts)
            self.delivered.append(_ser(r))

        self.service = DataplaneLinkServicer(_Source(self.commits), sink, layers=LAYERS, experts=EXPERTS)

    def seeds(self) -> list[Message]:
        if self.method == "WatchTables":
            return [dpb.WatchTablesRequest(from_version=v, shim_id="s0", ranks=[0]) for v in (0, 1, 3)]
        counts = np.arange(LAYERS * EXPERTS, dtype="<u4").tobytes()
        return [dpb.LoadReport(shim_id="s0", rank=0, first_step=f, steps=s, version=3, layers=LAYERS,
                               experts=EXPERTS, counts=counts) for f, s in ((0, 10), (20, 3), (5, 1))]

    def snapshot(self) -> Hashable:
        w = self.windows
        parts = tuple((k, p.counts.tobytes(), tuple(sorted(p.steps.items()))) for k, p in sorted(w._open.items()))
        return (tuple(self.delivered), parts, tuple(sorted(w._shims)), w._closed_upto)

    def must_refuse(self, req: Message) -> str:
        if isinstance(req, dpb.LoadReport):
            if (req.layers, req.experts) != (LAYERS, EXPERTS) or len(req.counts) != LAYERS * EXPERTS * 4:
                return "wrong shape or byte length"
            if req.steps < 1:
                return "no steps"
            if req.rank not in RANKS:
                return "another node's rank"
            if req.version > max(c.table.version for c in self.commits):
                return "a version past the committed head"
        return ""

    def call(self, req: Message) -> Verdict:
        return self.loop.run_until_complete(self._call(req))

    async def _call(self, req: Message) -> Verdict:
        ctx = FakeContext()
        if self.method == "WatchTables":
            got: list[int] = []
            try:
                async for upd in self.service.WatchTables(req, ctx):
                    got.append(int(upd.commit.table.version))
            except _EndOfStream:
                pass
            v = int(req.from_version)  # type: ignore[attr-defined]
            if got != sorted(set(got)) or any(x <= v for x in got):
                raise AssertionError(f"WatchTables from {v} streamed versions {got}")
            return Verdict(False, read_only=True)

        async def one() -> Any:
            yield req

        try:
            await self.service.ReportLoad(one(), ctx)
        except Aborted as e:
            if e.code not in REFUSAL_CODES:
                raise
            return Verdict(True, e.details)
        return Verdict(False)


class ShimStoreTarget(Target):
    """dataplane_shim TableStore.offer_commit (what the shim does with each commit the link streams)."""

    name = "Shim/OfferCommit"
    request = pb.Commit

    def __init__(self) -> None:
        self.tables = chain(4)
        self.fresh()

    def fresh(self) -> None:
        from dataplane_shim.tables import TableStore

        self.store = TableStore(TOPO, 0, self.tables[1], voters=VOTERS)

    def seeds(self) -> list[Message]:
        t = self.tables
        return [certify(t[2]), certify(t[3]), certify(t[1]), certify(t[2], ["a", "b", "c"], 3)]

    def snapshot(self) -> Hashable:
        s = self.store
        pend = None if s.pending is None else (s.pending.version, s.pending.digest)
        return (s.active.version, s.active.digest, pend, s.resident.tobytes(), s.state.tobytes(), s._todo.tobytes())

    def must_refuse(self, req: Message) -> str:
        c: pb.Commit = req  # type: ignore[assignment]
        if c.table.version <= self.store.head:
            return "version regression"
        if set(c.qc.voters) - set(VOTERS) or len(set(c.qc.voters)) < 2 or c.qc.quorum != 2:
            return "certificate with non-voters, too few voters, or a wrong quorum"
        if (c.table.layers, c.table.experts) != (LAYERS, EXPERTS):
            return "wrong shape"
        return ""

    def call(self, req: Message) -> Verdict:
        from dataplane_shim.errors import ShimError

        try:
            self.store.offer_commit(req)  # type: ignore[arg-type]
        except ShimError as e:
            return Verdict(True, str(e))
        return Verdict(False)
