"""Hostile input on the local link: the shim's TableStore.offer_commit (forged or partial certificates,
version regressions, wrong shapes) and the agent's DataplaneLink servicer (ReportLoad, WatchTables).
Each refusal is typed, names the problem, and leaves the state as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest

from agent.link.shim_link import serve_unix
from chaos.fuzz_link import LinkTarget, ShimStoreTarget
from chaos.fuzz_targets import LAYERS, TOPO, VOTERS, Aborted, FakeContext, certify, chain
from controlplane.table import RoutingTable
from dataplane_shim.errors import BadInput, ShimError, StaleVersion, Uncertified
from elasticmoe.v1 import consensus_pb2 as pb
from elasticmoe.v1 import dataplane_pb2 as dpb

T = chain(4)  # versions 1..4; the store starts at version 2


def offer_refused(c: pb.Commit, err: type[ShimError], expect: str, prime: list[pb.Commit] = ()) -> None:
    t = ShimStoreTarget()
    for p in prime:
        assert not t.call(p).rejected
    before = t.snapshot()
    with pytest.raises(err) as e:
        t.store.offer_commit(c)
    assert expect.lower() in str(e.value).lower(), e.value
    assert t.snapshot() == before


def test_store_takes_a_certified_successor() -> None:
    t = ShimStoreTarget()
    assert not t.call(certify(T[2])).rejected and t.store.head == 3


def _qc(c: pb.Commit, **kw: object) -> pb.Commit:
    for k, v in kw.items():
        if k == "voters":
            del c.qc.voters[:]
            c.qc.voters.extend(v)  # type: ignore[arg-type]
        else:
            setattr(c.qc, k, v)
    return c


@pytest.mark.parametrize("qc, expect", [
    (dict(voters=["a"]), "distinct voters"),                 # partial
    (dict(voters=["a", "a"]), "distinct voters"),            # one voter twice
    (dict(quorum=0), "distinct voters"),
    (dict(voters=["a"], quorum=1), "qc.quorum"),             # quorum lied about
    (dict(voters=["a", "mallory"]), "non-voters"),           # a stranger signs
    (dict(table_hash=b"\x05" * 32), "table_hash"),
    (dict(version=4), "qc.version"),
])
def test_forged_or_partial_certificates(qc: dict[str, object], expect: str) -> None:
    offer_refused(_qc(certify(T[2]), **qc), Uncertified, expect)


def test_missing_certificate_and_tampered_table() -> None:
    c = certify(T[2])
    c.ClearField("qc")
    offer_refused(c, Uncertified, "certificate")
    c = certify(T[2])
    phy = bytearray(c.table.phy2log)
    phy[8] ^= 2
    c.table.phy2log = bytes(phy)  # content_hash and qc still name the original
    offer_refused(c, Uncertified, "digest")


@pytest.mark.parametrize("delta", [-8, -1, 3, 8])
def test_phy2log_byte_length(delta: int) -> None:
    c = certify(T[2])
    raw = c.table.phy2log
    c.table.phy2log = raw[:delta] if delta < 0 else raw + b"\x00" * delta
    offer_refused(c, Uncertified, "phy2log")


def test_version_regressions() -> None:
    offer_refused(certify(T[1]), StaleVersion, "already holds")           # the active version again
    offer_refused(certify(T[0]), StaleVersion, "already holds")           # an older one
    offer_refused(certify(T[2]), StaleVersion, "already holds", prime=[certify(T[3])])  # behind the pending one
    huge = certify(T[2])
    huge.table.version = huge.qc.version = 2**64 - 1
    offer_refused(huge, Uncertified, "2^63")


def test_wrong_shapes_and_unknown_experts() -> None:
    more_layers = RoutingTable(TOPO, 8, np.vstack([T[2].phy2log] * 2), version=3, parent=2)
    offer_refused(certify(more_layers), BadInput, "shape")
    offer_refused(certify(RoutingTable(TOPO, 9, T[2].phy2log, version=3, parent=2)), BadInput, "shape")
    phy = T[2].phy2log.copy()
    phy[0, 0] = 42  # an expert that does not exist
    offer_refused(certify(RoutingTable(TOPO, 8, phy, version=3, parent=2)), BadInput, "expert 42")
    phy = T[2].phy2log.copy()
    phy[phy == 3] = -1  # expert 3 loses every replica
    offer_refused(certify(RoutingTable(TOPO, 8, phy, version=3, parent=2)), BadInput, "no replica")
    c = certify(T[2])
    c.table.slots_per_rank = 2
    offer_refused(c, Uncertified, "slots")


def test_voters_unknown_to_the_store_are_not_checked() -> None:
    """Without `voters` the shim can only check the certificate's own arithmetic (the agent checks members)."""
    from dataplane_shim.tables import TableStore

    s = TableStore(TOPO, 0, T[1])
    s.offer_commit(_qc(certify(T[2]), voters=["x", "y"]))
    assert s.head == 3 and VOTERS


# ---- the agent's DataplaneLink servicer ---------------------------------------------------------------
@pytest.fixture
def loop() -> asyncio.AbstractEventLoop:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def report(**kw: object) -> dpb.LoadReport:
    m = dpb.LoadReport(shim_id="s0", rank=0, first_step=0, steps=10, version=3, layers=LAYERS, experts=8,
                       counts=np.arange(LAYERS * 8, dtype="<u4").tobytes())
    for k, v in kw.items():
        setattr(m, k, v)
    return m


@pytest.mark.parametrize("kw, expect", [
    (dict(layers=LAYERS + 1), "shape"),
    (dict(experts=0), "shape"),
    (dict(layers=0, experts=0, counts=b""), "shape"),
    (dict(counts=b"\x00" * (LAYERS * 8 * 4 - 1)), "bytes"),
    (dict(counts=b"\x00" * (LAYERS * 8 * 4 + 4)), "bytes"),
    (dict(counts=b""), "bytes"),
    (dict(steps=0), "steps"),
    (dict(steps=10**6), "at most decision.window"),  # the sink refuses it (LocalWindows): its split is bounded
    (dict(first_step=2**64 - 1, steps=1), "overflow"),
    (dict(first_step=2**63, steps=4), "overflow"),
])
def test_report_load_refusals(loop: asyncio.AbstractEventLoop, kw: dict[str, object], expect: str) -> None:
    t = LinkTarget("ReportLoad", loop)
    before = t.snapshot()
    v = t.call(report(**kw))
    assert v.rejected and expect in v.reason, v
    assert t.snapshot() == before and t.service.rejected == 1 and t.service.accepted == 0


def test_report_load_saturated_counts_are_refused_and_windows_sum_wide(loop: asyncio.AbstractEventLoop) -> None:
    """0xFFFFFFFF counts are legal uint32 but no engine's batch: the agent refuses them (agent.link.reportguard).
    The windows themselves sum two of them in uint64 and clip to uint32 when the window closes."""
    t = LinkTarget("ReportLoad", loop)
    big = np.full(LAYERS * 8, 2**32 - 1, dtype="<u4").tobytes()
    before = t.snapshot()
    v = t.call(report(counts=big, first_step=0, steps=5))
    assert v.rejected and "count_above_batch" in v.reason and t.snapshot() == before, v
    for first in (0, 5):
        t.windows.add("s0", first, 5, np.frombuffer(big, dtype="<u4").reshape(LAYERS, 8))
    assert t.windows._closed_upto == 0 and not t.windows._open


@pytest.mark.parametrize("kw, expect", [
    (dict(rank=-1), "rank_not_here"),
    (dict(rank=2), "rank_not_here"),                 # the other node's
    (dict(version=4), "version_ahead"),              # the head is 3
    (dict(version=2**64 - 1), "version_ahead"),
    (dict(unreachable_ranks=[4]), "unreachable_not_ep"),
])
def test_report_load_refuses_what_no_engine_of_this_node_says(loop: asyncio.AbstractEventLoop,
                                                              kw: dict[str, object], expect: str) -> None:
    t = LinkTarget("ReportLoad", loop)
    before = t.snapshot()
    r = report(**{k: v for k, v in kw.items() if k != "unreachable_ranks"})
    r.unreachable_ranks.extend(kw.get("unreachable_ranks", []))  # type: ignore[arg-type]
    v = t.call(r)
    assert v.rejected and expect in v.reason, v
    assert t.snapshot() == before and sum(t.guard.refused.values()) == 1 and t.service.accepted == 0


def test_report_stream_stops_at_the_bad_report(loop: asyncio.AbstractEventLoop) -> None:
    """Reports before the bad one are delivered; the bad one and any after it change nothing."""
    t = LinkTarget("ReportLoad", loop)
    good, bad, later = report(first_step=0, steps=3), report(counts=b"\x01"), report(first_step=3, steps=3)
    assert not t.call(good).rejected
    after_good = t.snapshot()
    t.fresh()

    async def stream() -> AsyncIterator[dpb.LoadReport]:
        for r in (good, bad, later):
            yield r

    with pytest.raises(Aborted) as e:
        loop.run_until_complete(t.service.ReportLoad(stream(), FakeContext()))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "load report 1" in e.value.details
    assert t.snapshot() == after_good


@pytest.mark.parametrize("from_version", [2**64 - 1, 3, 99])
def test_watch_tables_from_beyond_the_head_streams_nothing(loop: asyncio.AbstractEventLoop, from_version: int) -> None:
    t = LinkTarget("WatchTables", loop)
    before = t.snapshot()
    assert t.call(dpb.WatchTablesRequest(from_version=from_version, ranks=[-1, 2**31 - 1])).read_only
    assert t.snapshot() == before


# ---- over the unix socket: malformed bytes never reach the servicer -----------------------------------
@pytest.mark.asyncio
async def test_malformed_report_bytes_get_invalid_argument(tmp_path: Path) -> None:
    got: list[dpb.LoadReport] = []
    src = type("S", (), {"head_version": lambda self: 1, "commits_since": lambda self, v: [], "wait_for_newer": lambda self, v: asyncio.sleep(3600)})()
    sock = str(tmp_path / "shim.sock")
    srv = await serve_unix(sock, src, got.append, layers=LAYERS, experts=8)
    try:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
            call = ch.stream_unary("/elasticmoe.v1.DataplaneLink/ReportLoad", request_serializer=None,
                                   response_deserializer=dpb.ReportLoadAck.FromString)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(iter([report().SerializeToString(), b"\x0a\xff\xff\xff\xff\x0f"]), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in e.value.details()
        assert len(got) == 1  # the good report before it was delivered
    finally:
        await srv.stop(None)
