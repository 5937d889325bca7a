"""The engines' measured step times on the load path: each sampled step's wall time (LoadReport.step_us) goes from
the node's shims into its window (the longest over its ranks: an EP step waits for its slowest), through gossip
(LoadWindow.step_us, covered by the window's signature, bounded like a report's) to the cluster windows (the
longest over the nodes), so that every voter fits its step time from the same figures (controlplane.steptime)."""

from __future__ import annotations

import numpy as np
import pytest

from agent.gossip.loadgossip import check_windows, make_window, node_window
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

    def suspect_ranks(self, ranks: object) -> list[str]:
        return []

    def publish_window(self, window_seq: int, first_step: int, steps: int, counts: object, learner: bool = False,
                       samples: object = None, sample_every: int = 0, step_us: np.ndarray | None = None) -> None:
        self.published.append((window_seq, step_us))

    def live_nodes(self) -> list[str]:
        return ["n1"]


def test_the_load_path_carries_the_reports_step_times_into_its_window_and_the_cluster_window() -> None:
    topo = Topology(1, 2, 4)
    g = _Gossip()
    closed: list[int] = []
    path = LoadPath("n1", topo, L, E, 10, g, lambda seq, *_: closed.append(seq), lambda r, v: None, lambda: "",
                    ReportGuard([0, 1], 2, 2, DEFAULT_MAX_BATCH_TOKENS, lambda: 1), sample_every=5)
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
