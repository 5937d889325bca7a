"""The engines' measured step times on the load path: each sampled step's wall time (LoadReport.step_us) goes from
the node's shims into its window (the longest over its ranks: an EP step waits for its slowest), through gossip
(LoadWindow.step_us, covered by the window's signature, bounded like a report's) to the cluster windows (the
longest over the nodes), so that every voter fits its step time from the same figures (controlplane.steptime)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from agent.gossip.windowform import check_windows, make_window, node_window
from agent.gossip.windowguard import window_payload
from agent.link.loadpath import ClusterWindows, LoadPath, LocalWindows
from agent.link.reportguard import DEFAULT_MAX_BATCH_TOKENS, MAX_STEP_US, ReportGuard
from agent.transport import InvalidArgument
from controlplane.topology import Topology
from dataplane_shim.link import make_load_report

L, E = 2, 3
ONE = np.ones((L, E), np.uint32)


def test_a_nodes_window_holds_the_longest_time_of_each_sampled_step_over_its_shims() -> None:
    lw = LocalWindows(L, E, window=10, sample_every=5)
    one = np.stack([ONE])
    assert lw.add("a", 0, 5, ONE, one, np.array([700], np.uint32)) == []  # steps 0..4 (step 0 sampled)
    assert lw.add("b", 0, 5, ONE, one, np.array([800], np.uint32)) == []
    assert lw.add("a", 5, 5, ONE, one, np.array([900], np.uint32)) == []  # steps 5..9 (step 5)
    [w] = lw.add("b", 5, 5, ONE, one, np.array([850], np.uint32))
    assert w.step_us is not None and w.step_us.tolist() == [800, 900]
    lw.add("a", 10, 10, ONE, np.stack([ONE, ONE]), np.array([700, 900], np.uint32))
    [w] = lw.add("b", 10, 10, ONE, np.stack([ONE, ONE]), None)  # b measured none: no times, the counts stay
    assert w.step_us is None and w.samples is not None


def test_cluster_windows_keep_the_longest_time_over_the_nodes_unless_one_measured_none() -> None:
    cw = ClusterWindows()
    r = np.ones((2, L, E), np.uint32)
    cw.add("n1", 0, ONE, r, np.array([1000, 2000], np.uint32))
    cw.add("n2", 0, ONE, r, np.array([1500, 1200], np.uint32))
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [0]
    assert cw.step_us[0].tolist() == [1500, 2000]
    cw.add("n1", 1, ONE, r, np.array([1000, 2000], np.uint32))
    cw.add("n2", 1, ONE, r, None)
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [1] and 1 not in cw.step_us


class _Gossip:
    def __init__(self) -> None:
        self.published: list[tuple[int, np.ndarray | None]] = []
        self.versions: list[np.ndarray | None] = []
        self.strides: list[np.ndarray | None] = []

    def suspect_ranks(self, ranks: object) -> list[str]:
        return []

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: object, learner: bool = False,
                       samples: object = None, sample_every: int = 0, step_us: np.ndarray | None = None,
                       step_version: np.ndarray | None = None, stride_us: np.ndarray | None = None) -> None:
        self.published.append((window_seq, step_us))
        self.versions.append(step_version)
        self.strides.append(stride_us)

    def live_nodes(self) -> list[str]:
        return ["n1"]


def _path(g: _Gossip, head: int = 1, close: Any = lambda seq, *_: None) -> LoadPath:
    """Node n1's load path (2 ranks, windows of 10 steps, every 5th sampled) publishing to `g`; `head`: its
    committed version (the guard refuses reports above it)."""
    return LoadPath("n1", Topology(1, 2, 4), L, E, 10, g, close, lambda r, v: None, lambda: "",
                    ReportGuard([0, 1], 2, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: head), sample_every=5)


def test_the_load_path_carries_the_reports_step_times_into_its_window_and_the_cluster_window() -> None:
    g = _Gossip()
    closed: list[int] = []
    path = _path(g, close=lambda seq, *_: closed.append(seq))
    for first, rank, t in ((0, 0, 1200), (0, 1, 1000), (5, 0, 1100), (5, 1, 1300)):
        path.on_report(make_load_report(f"r{rank}", rank, first, 5, 1, ONE, samples=np.stack([ONE]), sample_every=5,
                                        step_us=[t]))
    assert closed == [0]
    [(seq, step_us)] = g.published
    assert seq == 0 and step_us is not None and step_us.tolist() == [1200, 1300]
    assert path.cluster.step_us[0].tolist() == [1200, 1300]


def test_the_window_signature_covers_its_step_times() -> None:
    w = make_window("n1", 1, 2, 200, 100, ONE, samples=np.stack([ONE] * 4), sample_every=25,
                    step_us=np.array([1, 2, 3, 4], np.uint32))
    forged = type(w)()
    forged.CopyFrom(w)
    forged.step_us = np.array([1, 2, 3, 40], "<u4").tobytes()
    assert window_payload(forged) != window_payload(w)  # what the node signs differs: a relay cannot change them
    bare = make_window("n1", 1, 2, 200, 100, ONE, samples=np.stack([ONE] * 4), sample_every=25)
    assert bare.step_us == b"" and window_payload(bare) != window_payload(w)
    got = node_window(w)
    assert got.step_us is not None and got.step_us.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("times, what", [([1, 2, 3], "expected one little-endian uint32 per sampled step"),
                                         ([1, 0, 3, 4], r"step_us\[1\] = 0"),
                                         ([1, 2, 3, MAX_STEP_US + 1], rf"step_us\[3\] = {MAX_STEP_US + 1}")])
def test_gossip_refuses_step_times_of_another_shape_or_implausible(times: list[int], what: str) -> None:
    w = make_window("n1", 1, 2, 200, 100, ONE, samples=np.stack([ONE] * 4), sample_every=25)
    w.step_us = np.array(times, "<u4").tobytes()
    with pytest.raises(InvalidArgument, match=what):
        check_windows([w], (L, E))


# ---- the version each sampled step ran on (LoadWindow.step_version) ------------------------------------------

def test_a_nodes_window_says_the_oldest_version_each_sampled_step_ran_on() -> None:
    """A plugin reports the steps before an install apart from those after it (LoadReport.version): the window
    holds, per sampled step, the oldest version any of the node's ranks ran it on (a rank still on the old table
    holds the step back); a report that says no version leaves the window without them, its times kept."""
    lw = LocalWindows(L, E, window=10, sample_every=5)
    one = np.stack([ONE])
    t = np.array([900], np.uint32)
    lw.add("a", 0, 5, ONE, one, t, version=1)
    lw.add("b", 0, 5, ONE, one, t, version=1)
    lw.add("a", 5, 5, ONE, one, t, version=2)  # a installed v2 at step 5
    [w] = lw.add("b", 5, 5, ONE, one, t, version=1)  # b had not yet
    assert w.step_version is not None and w.step_version.tolist() == [1, 1]
    lw.add("a", 10, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32), version=2)
    [w] = lw.add("b", 10, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32), version=2)
    assert w.step_version is not None and w.step_version.tolist() == [2, 2]
    lw.add("a", 20, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32), version=2)
    [w] = lw.add("b", 20, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32))  # no version said
    assert w.step_version is None and w.step_us is not None


def test_cluster_windows_keep_the_oldest_version_over_the_nodes_unless_one_said_none() -> None:
    cw = ClusterWindows()
    r = np.ones((2, L, E), np.uint32)
    us = np.array([1000, 2000], np.uint32)
    cw.add("n1", 0, ONE, r, us, np.array([3, 4], np.uint32))
    cw.add("n2", 0, ONE, r, us, np.array([3, 3], np.uint32))
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [0]
    assert cw.step_version[0].tolist() == [3, 3]
    cw.add("n1", 1, ONE, r, us, np.array([4, 4], np.uint32))
    cw.add("n2", 1, ONE, r, us, None)
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [1] and 1 not in cw.step_version and 1 in cw.step_us


def test_the_load_path_carries_the_reports_versions_into_its_window_and_the_cluster_window() -> None:
    g = _Gossip()
    path = _path(g, head=2)
    for first, rank, v in ((0, 0, 1), (0, 1, 1), (5, 0, 2), (5, 1, 2)):
        path.on_report(make_load_report(f"r{rank}", rank, first, 5, v, ONE, samples=np.stack([ONE]), sample_every=5,
                                        step_us=[1000]))
    [ran] = g.versions
    assert ran is not None and ran.tolist() == [1, 2]
    assert path.cluster.step_version[0].tolist() == [1, 2]


def _signed_and_bounded(field: str, good: list[int], forged: list[int], bad: list[tuple[list[int], str]]) -> None:
    """A window's per-sampled-step `field` beside its step_us (4 sampled steps): decoded as sent, covered by the
    window's signature (a relay that changes it changes what the node signed), and refused by gossip as `bad`
    says (each value and the message it must name)."""
    kw: dict[str, Any] = dict(samples=np.stack([ONE] * 4), sample_every=25, step_us=np.array([1, 2, 3, 4], np.uint32))
    w = make_window("n1", 1, 2, 200, 100, ONE, **kw, **{field: np.array(good, np.uint32)})
    assert getattr(node_window(w), field).tolist() == good
    f = type(w)()
    f.CopyFrom(w)
    setattr(f, field, np.array(forged, "<u4").tobytes())
    assert window_payload(f) != window_payload(w)
    bare = make_window("n1", 1, 2, 200, 100, ONE, **kw)
    assert getattr(bare, field) == b"" and getattr(node_window(bare), field) is None
    for values, what in bad:
        setattr(w, field, np.array(values, "<u4").tobytes())
        with pytest.raises(InvalidArgument, match=what):
            check_windows([w], (L, E))
    with pytest.raises(ValueError, match=field):
        make_window("n1", 1, 2, 200, 100, ONE, **kw, **{field: np.array(good[:3], np.uint32)})


def test_the_window_signature_covers_its_step_versions_and_gossip_bounds_them() -> None:
    _signed_and_bounded("step_version", [5, 5, 6, 6], [5, 5, 5, 6],  # (a relay cannot move the install)
                        [([5, 5, 6], "expected one little-endian uint32 per sampled step"),
                         ([5, 0, 6, 6], r"step_version\[1\] = 0")])


def test_a_report_without_a_sampled_step_keeps_the_windows_times() -> None:
    """A plugin flushes its steps before an install: a report of 2 steps may hold no sampled step, and so no
    time; the window's sampled steps are still all timed."""
    lw = LocalWindows(L, E, window=10, sample_every=5)
    lw.add("a", 0, 3, ONE, np.stack([ONE]), np.array([700], np.uint32), version=1)  # steps 0..2 (0 sampled)
    lw.add("a", 3, 2, ONE, np.zeros((0, L, E), np.uint32), None, version=2)  # steps 3..4: none sampled
    [w] = lw.add("a", 5, 5, ONE, np.stack([ONE]), np.array([900], np.uint32), version=2)
    assert w.step_us is not None and w.step_us.tolist() == [700, 900]
    assert w.step_version is not None and w.step_version.tolist() == [1, 2]


# ---- the mean time of the steps each sampled step stands for (LoadWindow.stride_us) ---------------------------

def test_windows_keep_the_longest_stride_mean_over_the_shims_and_the_nodes_unless_one_measured_none() -> None:
    lw = LocalWindows(L, E, window=10, sample_every=5)
    one = np.stack([ONE])
    t = np.array([900], np.uint32)
    lw.add("a", 0, 5, ONE, one, t, stride_us=np.array([700], np.uint32))
    lw.add("b", 0, 5, ONE, one, t, stride_us=np.array([800], np.uint32))
    lw.add("a", 5, 5, ONE, one, t, stride_us=np.array([950], np.uint32))
    [w] = lw.add("b", 5, 5, ONE, one, t, stride_us=np.array([850], np.uint32))
    assert w.stride_us is not None and w.stride_us.tolist() == [800, 950]
    lw.add("a", 10, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32),
           stride_us=np.array([900, 900], np.uint32))
    [w] = lw.add("b", 10, 10, ONE, np.stack([ONE, ONE]), np.array([900, 900], np.uint32))  # b sent no strides
    assert w.stride_us is None and w.step_us is not None
    cw = ClusterWindows()
    r = np.ones((2, L, E), np.uint32)
    us = np.array([1000, 2000], np.uint32)
    cw.add("n1", 0, ONE, r, us, None, np.array([1100, 1900], np.uint32))
    cw.add("n2", 0, ONE, r, us, None, np.array([1000, 2100], np.uint32))
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [0]
    assert cw.stride_us[0].tolist() == [1100, 2100]
    cw.add("n1", 1, ONE, r, us, None, np.array([1100, 1900], np.uint32))
    cw.add("n2", 1, ONE, r, us)
    assert [k for k, *_ in cw.ready(["n1", "n2"])] == [1] and 1 not in cw.stride_us and 1 in cw.step_us


def test_the_load_path_carries_the_reports_stride_means_and_the_signature_covers_them() -> None:
    g = _Gossip()
    path = _path(g)
    for first, rank, s in ((0, 0, 1100), (0, 1, 1000), (5, 0, 1200), (5, 1, 1250)):
        path.on_report(make_load_report(f"r{rank}", rank, first, 5, 1, ONE, samples=np.stack([ONE]), sample_every=5,
                                        step_us=[1000], stride_us=[s]))
    [strides] = g.strides
    assert strides is not None and strides.tolist() == [1100, 1250]
    assert path.cluster.stride_us[0].tolist() == [1100, 1250]
    _signed_and_bounded("stride_us", [2, 2, 3, 3], [2, 2, 3, 30],
                        [([2, 2, 3], "expected one little-endian uint32 per sampled step"),
                         ([2, 0, 3, 3], r"stride_us\[1\] = 0"),
                         ([2, 2, 3, MAX_STEP_US + 1], rf"stride_us\[3\] = {MAX_STEP_US + 1}")])
