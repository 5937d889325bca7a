"""The per-step signal of the load path (elasticmoe.loadcodec): every `sample_every`-th step's counts travel
beside the window totals from the engine plugin (PluginCore) through the node's windows (LocalWindows) and
gossip (LoadWindow.samples, zlib) to the cluster windows (ClusterWindows), summed step by step; anything
that came without them leaves the window to its totals."""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest

from agent.gossip.windowform import check_windows, window_samples
from agent.link.loadpath import ClusterWindows, LoadPath, LocalWindows
from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, ReportGuard
from agent.transport import InvalidArgument
from controlplane.topology import Topology
from dataplane_shim.errors import BadInput
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import check_load_report, make_load_report
from dataplane_shim.plugin import PluginCore
from elasticmoe.loadcodec import RowsError, pack_rows, sample_steps, stride_means, unpack_rows
from elasticmoe.v1 import gossip_pb2 as gpb

L, E = 2, 3


def test_the_sampled_steps_are_the_global_multiples() -> None:
    assert list(sample_steps(0, 100, 10)) == list(range(0, 100, 10))
    assert list(sample_steps(95, 32, 10)) == [100, 110, 120]  # a report crossing a window boundary
    assert list(sample_steps(101, 9, 10)) == []
    assert list(sample_steps(0, 100, 0)) == []  # sampling off


def test_a_sampled_step_stands_for_its_stride_and_reports_its_mean_time() -> None:
    """Steps 7..18 of a report, every 5th sampled (10 and 15): 10 stands for 10..14, 15 for 15..18 (the report
    ends); the steps before the first sampled one belong to the last report's; an unmeasured step (0) is left
    out of its stride's mean, and a sampled step that was not measured has none."""
    t = np.arange(7, 19, dtype=np.float64) * 10.0  # step s took 10 s us
    assert stride_means(t, 7, 5) == [120.0, 165.0]  # mean(100..140), mean(150..180)
    t[4] = 0.0  # step 11
    assert stride_means(t, 7, 5) == [pytest.approx((100 + 120 + 130 + 140) / 4), 165.0]
    t[3] = 0.0  # step 10, sampled
    assert stride_means(t, 7, 5) == [None, 165.0]
    assert stride_means(t, 7, 0) == []


def test_rows_round_trip_and_a_bomb_or_a_short_payload_is_refused() -> None:
    rows = np.arange(4 * L * E, dtype=np.uint32).reshape(4, L, E)
    assert (unpack_rows(pack_rows(rows), 4, L, E) == rows).all()
    with pytest.raises(RowsError, match="expected 3 rows"):
        unpack_rows(pack_rows(rows), 3, L, E)  # more data than the shape: stops at the expected size
    with pytest.raises(RowsError, match="expected 5 rows"):
        unpack_rows(pack_rows(rows), 5, L, E)
    with pytest.raises(RowsError, match="not zlib"):
        unpack_rows(b"not zlib", 4, L, E)
    bomb = zlib.compress(bytes(1 << 24))  # 16 MiB of zeros in ~16 KiB
    with pytest.raises(RowsError):
        unpack_rows(bomb, 4, L, E)


def test_local_windows_sum_each_sampled_step_over_the_shims_and_split_at_the_boundary() -> None:
    lw = LocalWindows(L, E, window=20, sample_every=5)
    one = np.ones((L, E), np.uint32)
    # shim a reports steps 0..11 (samples 0, 5, 10) then 12..23 (15, 20); shim b 0..19 (0, 5, 10, 15)
    a1 = np.stack([one * 1, one * 2, one * 3])
    assert lw.add("a", 0, 12, one * 12, a1) == []
    assert lw.add("b", 0, 20, one * 20, np.stack([one * 10] * 4)) == []
    closed = lw.add("a", 12, 12, one * 12, np.stack([one * 4, one * 5]))
    assert [w.seq for w in closed] == [0]
    w = closed[0]
    assert w.samples is not None and w.samples.shape == (4, L, E)
    assert w.samples[:, 0, 0].tolist() == [11, 12, 13, 14]  # steps 0, 5, 10, 15: a's and b's rows
    assert int(w.counts[0, 0]) == 12 + 20 + 12 * 8 // 12  # totals split by steps, as before


def test_a_report_without_samples_leaves_its_window_to_the_totals() -> None:
    lw = LocalWindows(L, E, window=10, sample_every=5)
    one = np.ones((L, E), np.uint32)
    assert lw.add("b", 0, 5, one, np.stack([one])) == []
    assert lw.add("a", 0, 10, one, np.stack([one, one])) == []
    [w] = lw.add("b", 5, 5, one, None)  # b's steps 5..9 came without their sample (step 5)
    assert w.samples is None and int(w.counts[0, 0]) == 3


def test_cluster_windows_sum_samples_unless_a_node_sent_none() -> None:
    cw = ClusterWindows()
    r = np.ones((2, L, E), np.uint32)
    cw.add("n1", 0, np.ones((L, E), np.uint32), r)
    cw.add("n2", 0, np.ones((L, E), np.uint32), r * 3)
    [(seq, total, samples, missing)] = cw.ready(["n1", "n2"])
    assert not missing and seq == 0 and int(total[0, 0]) == 2 and samples is not None and (samples == 4).all()
    cw.add("n1", 1, np.ones((L, E), np.uint32), r)
    cw.add("n2", 1, np.ones((L, E), np.uint32), None)
    [(_, _, samples, _)] = cw.ready(["n1", "n2"])
    assert samples is None


def _window(samples: bytes, every: int) -> gpb.LoadWindow:
    return gpb.LoadWindow(node_id="n1", window_seq=1, layers=L, experts=E, steps=100, first_step=100,
                          counts=np.ones((L, E), "<u4").tobytes(), samples=samples, sample_every=every)


def test_gossip_refuses_samples_that_do_not_decode_to_the_window_shape() -> None:
    good = _window(pack_rows(np.ones((4, L, E), np.uint32)), 25)  # steps 100, 125, 150, 175
    check_windows([good], (L, E))
    got = window_samples(good)
    assert got is not None and got.shape == (4, L, E)
    for bad, what in ((_window(pack_rows(np.ones((3, L, E), np.uint32)), 25), "expected 4 rows"),
                      (_window(b"\x00" * 10, 25), "not zlib"),
                      (_window(pack_rows(np.ones((4, L, E), np.uint32)), 0), "expected both or neither")):
        with pytest.raises(InvalidArgument, match=what):
            check_windows([bad], (L, E))


def test_the_plugin_reports_its_sampled_steps_and_the_agent_checks_their_size() -> None:
    topo = Topology(1, 2, 2)
    sent = []

    class Link:
        next_step = 0

        def dropped(self) -> int:
            return 0

        def drain(self) -> list:
            return []

        def offer(self, report) -> None:  # type: ignore[no-untyped-def]
            sent.append(report)

        def go_on_from(self, step: int) -> None:
            pass

        def report(self, report, timeout: float) -> None:  # type: ignore[no-untyped-def]
            self.offer(report)

    core = PluginCore(Link(), topo, L, 4, 0, genesis_table("static", topo, L, 4).phy2log, genesis="static",
                      report_every=8, sample_every=3)
    for step in range(8):
        offs = core.sampled(1)
        core.add_load(np.full((L, 4), step), 1, np.full((len(offs), L, 4), step) if offs else None)
    assert core.maybe_report()
    r = sent[0]
    assert (r.first_step, r.steps, r.sample_every) == (0, 8, 3) and check_load_report(r, L, 4) == ""
    rows = np.frombuffer(r.samples, "<u4").reshape(-1, L, 4)
    assert rows[:, 0, 0].tolist() == [0, 3, 6]  # steps 0, 3 and 6 of 0..7
    core.add_load(np.ones((L, 4), np.int64), 4, np.ones((1, L, 4), np.int64))  # steps 8..11 sample 9: one row
    with pytest.raises(BadInput, match="sampled rows shape"):
        core.add_load(np.ones((L, 4), np.int64), 3, np.ones((2, L, 4), np.int64))  # 12..14 sample 12 only
    r.samples = r.samples[:-4]
    assert "samples has" in check_load_report(r, L, 4)
    assert "samples has" in check_load_report(
        make_load_report("s", 0, 0, 4, 1, np.ones((L, 4), np.uint32)).__class__(
            shim_id="s", rank=0, first_step=0, steps=4, layers=L, experts=4,
            counts=np.ones((L, 4), "<u4").tobytes(), sample_every=2), L, 4)


class _Gossip:
    def __init__(self) -> None:
        self.published: list[tuple] = []

    def suspect_ranks(self, ranks) -> list[str]:  # type: ignore[no-untyped-def]
        return []

    def publish_window(self, *a) -> None:  # type: ignore[no-untyped-def]
        self.published.append(a)

    def live_nodes(self) -> list[str]:
        return ["n1"]


def test_a_report_sampled_at_another_rate_is_used_for_its_totals_and_named() -> None:
    g, closed = _Gossip(), []
    lp = LoadPath("n1", Topology(1, 1, 4), L, E, 10, g, lambda s, t, rows, missing: closed.append((s, t, rows)),
                  lambda rank, v: None, lambda: "", ReportGuard([0], 1, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: 1),
                  sample_every=5)
    one = np.ones((L, E), np.uint32)
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("agent.link.loadpath")  # (the agent's CLI tests may have set its level and propagation)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        lp.on_report(make_load_report("s", 0, 0, 10, 1, one, samples=np.stack([one] * 5), sample_every=2))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert any("EMOE_SAMPLE_EVERY to 5" in m for m in said) and lp.unsampled == 1
    assert len(closed) == 1 and closed[0][2] is None and int(closed[0][1][0, 0]) == 1
    lp.on_report(make_load_report("s", 0, 10, 10, 1, one, samples=np.stack([one * 2] * 2), sample_every=5))
    assert closed[1][2] is not None and closed[1][2].shape == (2, L, E)
    assert g.published[-1][6] == 5  # gossiped with its sample_every
