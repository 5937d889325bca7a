"""The engine plugin's core: genesis check, version agreement (MIN over ranks), load reports."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.ops import Consolidate, Replicate, apply_ops
from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim.certify import certified_commit
from dataplane_shim.errors import BadInput
from dataplane_shim.genesis import genesis_table, vllm_boot_phy2log
from dataplane_shim.link import check_load_report
from dataplane_shim.plugin import GenesisMismatch, PluginCore
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import dataplane_pb2 as dpb

TOPO = Topology(1, 2, 5)
L, E = 2, 8


class FakeLink:
    def __init__(self) -> None:
        self.inbox: list[cpb.Commit] = []
        self.sent: list[dpb.LoadReport] = []
        self.dropped = 0
        self.next_step = 0  # what the agent said to go on from (ReportLoadAck.next_step)

    def drain(self) -> list[cpb.Commit]:
        out, self.inbox = self.inbox, []
        return out

    def offer(self, report: dpb.LoadReport) -> None:
        self.sent.append(report)

    def go_on_from(self, step: int) -> None:
        self.renumbered_to = step

    def report(self, report, timeout: float) -> None:  # type: ignore[no-untyped-def]
        self.offer(report)


def chain(n: int) -> list[RoutingTable]:
    """Versions 2..n+1 after the vLLM genesis: free a redundant slot, then fill it with another expert."""
    out = [genesis_table("vllm", TOPO, L, E)]
    for k in range(n):
        head = out[-1]
        if k % 2 == 0:
            nxt = apply_ops(head, [Consolidate(0, (k % 2,), 0)])
        else:
            nxt = apply_ops(head, [Replicate(0, 2 + k, 1)])
        out.append(nxt)
    return out[1:]


def core(rank: int, link: FakeLink, **kw: object) -> PluginCore:
    return PluginCore(link, TOPO, L, E, rank, vllm_boot_phy2log(L, E, TOPO.slots), **kw)  # type: ignore[arg-type]


def test_genesis_mismatch_names_both_digests() -> None:
    with pytest.raises(GenesisMismatch, match=r"engine booted with placement [0-9a-f]{16}, the agents' genesis "
                                              r"'static' is [0-9a-f]{16} \(first difference: layer 0 slot 4"):
        core(0, FakeLink(), genesis="static")
    boot = vllm_boot_phy2log(L, E, TOPO.slots)
    boot[1, 9] = 5
    with pytest.raises(GenesisMismatch, match="layer 1 slot 9: engine expert 5, genesis expert 1"):
        PluginCore(FakeLink(), TOPO, L, E, 0, boot)
    with pytest.raises(BadInput, match=r"shape \(2, 9\)"):
        PluginCore(FakeLink(), TOPO, L, E, 0, boot[:, :9])


def test_a_genesis_mismatch_is_told_to_the_agent_before_the_plugin_stops() -> None:
    link = FakeLink()
    with pytest.raises(GenesisMismatch):
        core(1, link, genesis="static")
    (r,) = link.sent
    assert r.error.startswith("GENESIS_MISMATCH: the engine booted with placement") and r.rank == 1
    assert r.steps == 0 and not any(r.counts) and check_load_report(r, L, E) == ""


def test_a_version_is_installed_only_once_every_rank_holds_it() -> None:
    links = [FakeLink(), FakeLink()]
    ranks = [core(0, links[0]), core(1, links[1])]
    v2, v3 = chain(2)
    links[0].inbox += [certified_commit(v2, ["a", "b"], 2), certified_commit(v3, ["a", "b"], 2)]

    def agree() -> list[RoutingTable | None]:
        red = np.min([r.agreement_vector() for r in ranks], axis=0)
        return [r.decide(red) for r in ranks]

    assert agree() == [None, None]  # rank 1 holds nothing newer
    assert ranks[0].stats.waits == 1
    links[1].inbox.append(certified_commit(v2, ["a", "b"], 2))
    got = agree()
    assert got[0] is not None and got[1] is not None and got[0].version == got[1].version == 2
    for r in ranks:
        r.installed(2)
    assert agree() == [None, None] and ranks[0].version == 2
    links[1].inbox.append(certified_commit(v3, ["a", "b"], 2))
    got = agree()
    assert [t.version if t else None for t in got] == [3, 3]
    assert got[0] is not None and got[0].content_equal(v3)


def test_a_rank_that_started_from_a_later_base_waits_for_the_others() -> None:
    """Rank 0 holds only v4 (its stream began after v3), rank 1 holds v2, v3: agreed 3 < floor 4, so nothing
    installs until rank 1 has v4, then both install v4."""
    links = [FakeLink(), FakeLink()]
    ranks = [core(0, links[0]), core(1, links[1])]
    v2, v3, v4 = chain(3)
    links[0].inbox.append(certified_commit(v4, ["a", "b"], 2))
    links[1].inbox += [certified_commit(v, ["a", "b"], 2) for v in (v2, v3)]
    red = np.min([r.agreement_vector() for r in ranks], axis=0)
    assert red.tolist() == [3, -4] and [r.decide(red) for r in ranks] == [None, None]
    links[1].inbox.append(certified_commit(v4, ["a", "b"], 2))
    red = np.min([r.agreement_vector() for r in ranks], axis=0)
    assert [t.version for t in (r.decide(red) for r in ranks) if t] == [4, 4]


def test_uncertified_stale_and_misshapen_commits_are_refused() -> None:
    link = FakeLink()
    c = core(0, link)
    (v2,) = chain(1)
    bad = certified_commit(v2, ["a", "b"], 2)
    bad.qc.table_hash = b"\0" * 32
    stale = certified_commit(genesis_table("vllm", TOPO, L, E), ["a", "b"], 2)
    other = certified_commit(RoutingTable(TOPO, E, vllm_boot_phy2log(3, E, 10), 2, 1), ["a", "b"], 2)
    link.inbox += [bad, stale, other]
    assert c.receive() == 0 and c.stats.refused == 3 and not c.tables


def test_load_is_reported_every_k_steps_with_its_span() -> None:
    link = FakeLink()
    c = core(1, link, report_every=3)
    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 50, (L, E)) for _ in range(7)]
    for s in steps:
        c.add_load(s)
        c.maybe_report()
    assert [(r.first_step, r.steps) for r in link.sent] == [(0, 3), (3, 3)]
    got = np.frombuffer(link.sent[1].counts, "<u4").reshape(L, E)
    np.testing.assert_array_equal(got, sum(steps[3:6]))
    assert link.sent[0].rank == 1 and link.sent[0].version == 1 and link.sent[0].shim_id == "rank1"
    with pytest.raises(BadInput, match="load shape"):
        c.add_load(np.zeros((L, E + 1)))


def test_flush_reports_the_pending_steps_under_the_running_version_then_nothing() -> None:
    link = FakeLink()
    c = core(1, link)
    assert not c.flush()  # nothing pending: no empty report
    c.add_load(np.full((L, E), 2), steps=1)
    assert c.flush() and not c.flush()
    c.add_load(np.full((L, E), 3), steps=2)
    c.flush()
    assert [(r.first_step, r.steps, r.version) for r in link.sent] == [(0, 1, 1), (1, 2, 1)]
    assert [int(np.frombuffer(r.counts, "<u4").sum()) for r in link.sent] == [2 * L * E, 3 * L * E]


def test_an_unreachable_peer_rides_the_next_report_once() -> None:
    link = FakeLink()
    c = core(1, link)
    c.peer_unreachable(0)
    c.add_load(np.zeros((L, E), dtype=np.int64))
    c.maybe_report()
    c.add_load(np.zeros((L, E), dtype=np.int64))
    c.maybe_report()
    assert [list(r.unreachable_ranks) for r in link.sent] == [[0], []]
    with pytest.raises(BadInput, match="unreachable rank 1"):
        c.peer_unreachable(1)  # itself
    with pytest.raises(BadInput, match="unreachable rank"):
        c.peer_unreachable(TOPO.ranks)


def test_a_core_may_number_its_steps_from_a_later_step() -> None:
    """`emoe load replay` starts past the agents' newest window (a report into a closed window is dropped as
    late): the first report, and the sampled steps, count from `first_step`."""
    link = FakeLink()
    c = core(0, link, report_every=5, sample_every=4, first_step=2000)
    assert c.sampled(5) == [0, 4]  # global steps 2000 and 2004
    for _ in range(5):
        c.add_load(np.ones((L, E), np.int64), 1, np.ones((1, L, E), np.int64) if c.is_sampled(0) else None)
        c.maybe_report()
    [r] = link.sent
    assert (r.first_step, r.steps, r.sample_every) == (2000, 5, 4)
    with pytest.raises(BadInput, match="first_step=-1"):
        core(0, FakeLink(), first_step=-1)


def test_a_sampled_step_reports_its_own_time_and_its_strides_mean_and_none_when_its_own_is_missing() -> None:
    """A sampled step stands for itself and the steps after it up to the next sampled one (within the report): it
    reports its own wall time (LoadReport.step_us) and their mean (stride_us), which has a fraction of one step's
    noise (elasticmoe.loadcodec.stride_means)."""
    link = FakeLink()
    c = core(0, link, report_every=6, sample_every=2)
    rng = np.random.default_rng(1)
    for k in range(12):  # steps 0..11: the sampled 0, 2, 4 and 6, 8, 10; step 8's time never comes
        row = rng.integers(0, 50, (L, E))
        if k != 8:
            c.step_took(0, 1000.0 + 2 * k)
        c.add_load(row, 1, row[None] if c.is_sampled(0) else None)
        c.maybe_report()
    first, second = link.sent
    assert np.frombuffer(first.step_us, "<u4").tolist() == [1000, 1004, 1008]
    assert np.frombuffer(first.stride_us, "<u4").tolist() == [1001, 1005, 1009]  # (1000 + 1002) / 2, ...
    assert check_load_report(first) == ""
    assert second.step_us == second.stride_us == b"" and len(second.samples) > 0  # one sampled step untimed: none
    c.step_took(0, 5.0)  # steps 12 (sampled) and 13 (not): 12 stands for both
    c.step_took(1, 7.0)
    row = np.ones((L, E), np.int64)
    c.add_load(np.stack([row, row]).sum(0), 2, row[None])
    c.flush()
    assert np.frombuffer(link.sent[-1].step_us, "<u4").tolist() == [5]
    assert np.frombuffer(link.sent[-1].stride_us, "<u4").tolist() == [6]
    c.step_took(0, 9.0)  # step 14 (sampled) timed, 15 (not) untimed: the mean of those measured
    c.add_load(np.stack([row, row]).sum(0), 2, row[None])
    c.flush()
    assert np.frombuffer(link.sent[-1].stride_us, "<u4").tolist() == [9]
    c.step_took(0, 20.0)  # a stride cut by the report's end: step 16 alone, flushed before an install
    c.add_load(row, 1, row[None])
    c.flush()
    assert np.frombuffer(link.sent[-1].stride_us, "<u4").tolist() == [20]
    bad = link.sent[-1]
    bad.stride_us = b"\x01\x00\x00\x00" * 2
    assert "stride_us has 8 bytes" in check_load_report(bad)
