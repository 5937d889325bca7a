from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.link.loadpath import ClusterWindows, LoadReportError, LocalWindows


def test_local_window_closes_when_every_shim_reported() -> None:
    lw = LocalWindows(2, 3, window=10)
    one = np.ones((2, 3), np.uint32)
    assert lw.add("a", 0, 5, one) == []
    assert lw.add("b", 0, 10, one) == []  # shim a has 5 of 10 steps
    closed = lw.add("a", 5, 5, one)
    assert [(w.seq, w.first_step) for w in closed] == [(0, 0)]
    assert (closed[0].counts == 3).all()


def test_local_window_rejects_bad_reports() -> None:
    lw = LocalWindows(2, 3, window=10)
    with pytest.raises(LoadReportError, match="shape"):
        lw.add("a", 0, 10, np.ones((3, 2), np.uint32))
    with pytest.raises(LoadReportError, match="steps = 0"):
        lw.add("a", 0, 0, np.ones((2, 3), np.uint32))
    with pytest.raises(LoadReportError, match="steps = 11: expected at most decision.window = 10"):
        lw.add("a", 0, 11, np.ones((2, 3), np.uint32))  # more than a window: an engine misconfigured, or hostile


def test_reports_across_window_boundaries_are_split_by_steps() -> None:
    """The plugins report every 16 steps by default and the agents' window is 100 steps: the report of steps
    96-111 is split 4 : 12 between windows 0 and 1. It was refused: one report in six of every engine on the
    defaults was dropped, so each window missed 16 steps of load and closed only once a window two later
    arrived (the lag rule), partial. Nothing is lost or counted twice now."""
    lw = LocalWindows(1, 3, window=100)
    closed = []
    for first in range(0, 224, 16):
        closed += lw.add("a", first, 16, np.array([[160, 16, 7]], np.uint32))
    assert [(w.seq, w.first_step) for w in closed] == [(0, 0), (1, 100)]
    # expert 2, 7 a report: window 0 has 6 whole reports and 7 x 4 // 16 = 1 of steps 96-111 (43); window 1
    # the other 6 of it, 5 whole reports and 7 x 8 // 16 = 3 of steps 192-207 (44)
    assert [w.counts.tolist() for w in closed] == [[[1000, 100, 43]], [[1000, 100, 44]]]


def test_cluster_window_needs_every_live_node() -> None:
    cw = ClusterWindows()
    cw.add("n1", 0, np.full((2, 2), 1, np.uint32))
    assert cw.ready(["n1", "n2"]) == []
    cw.add("n2", 0, np.full((2, 2), 2, np.uint32))
    ready = cw.ready(["n1", "n2"])
    assert [k for k, *_ in ready] == [0] and (ready[0][1] == 3).all()
    assert cw.ready(["n1", "n2"]) == []  # each window once
    cw.add("n1", 1, np.full((2, 2), 1, np.uint32))
    assert [k for k, *_ in cw.ready(["n1"])] == [1]  # n2 declared dead: the survivors' sum


def test_a_lagging_node_cannot_stall_cluster_windows() -> None:
    cw = ClusterWindows(lag=2)
    one = np.ones((2, 2), np.uint32)
    cw.add("slow", 0, one)
    for k in range(5):
        cw.add("fast", k, one * 2)
    ready = cw.ready(["fast", "slow"])
    # 0 is complete; 1 and 2 close without the slow node once fast is 2 windows past them
    assert [k for k, *_ in ready] == [0, 1, 2]
    assert (ready[0][1] == 3).all() and (ready[1][1] == 2).all()
    assert [m for *_, m in ready] == [(), ("slow",), ("slow",)]  # each window names who is missing from it
    assert cw.partial == 2
    cw.add("slow", 1, one)  # too late: window 1 is closed
    assert cw.ready(["fast", "slow"]) == []
    cw.add("slow", 3, one)
    assert [k for k, *_ in cw.ready(["fast", "slow"])] == [3]


def test_the_newest_reported_window_is_vouched_for_by_the_last_closed_one() -> None:
    """What a commit's observation starts from (controller.TableCommitted.newest_window): the newest window
    reported, but a seq far past the last closed window (a dead node's, a skewed clock's, a forged one) cannot
    push it out of reach, where the change would never be judged and no rebalance could follow it."""
    cw = ClusterWindows(lag=2)
    one = np.ones((2, 2), np.uint32)
    assert cw.newest_reported() == -1  # nothing closed yet: not known
    for k in range(3):
        cw.add("a", k, one)
        cw.add("b", k, one)
    cw.add("a", 3, one)
    assert [k for k, *_ in cw.ready(["a", "b"])] == [0, 1, 2]
    assert cw.newest_reported() == 3  # a reported window 3; 4 is open
    cw.add("c", 10**9, one)  # not a live node's: nothing closes
    assert cw.ready(["a", "b"]) == [] and cw.newest_reported() == 2 + 2 + 1


class _ReferenceClusterWindows:
    """ClusterWindows without its fast path (the definition: every call looks at every live node)."""

    def __init__(self, keep: int = 8, lag: int = 2) -> None:
        self.keep, self.lag = keep, lag
        self.by: dict[str, dict[int, np.ndarray]] = {}
        self.last_closed = -1

    def add(self, node: str, seq: int, counts: np.ndarray) -> None:
        if seq <= self.last_closed:
            return
        w = self.by.setdefault(node, {})
        w[seq] = counts
        for k in sorted(w)[:-self.keep]:
            del w[k]

    def ready(self, live: list[str]) -> list[tuple[int, int]]:
        held = [self.by[n] for n in live if self.by.get(n)]
        if not held:
            return []
        newest = max(max(w) for w in held)
        out = []
        for k in sorted({k for w in held for k in w if k > self.last_closed}):
            complete = len(held) == len(live) and all(k in w for w in held)
            if not complete and newest < k + self.lag:
                break
            out.append((k, int(sum(int(w[k].sum()) for w in held if k in w))))
            self.last_closed = k
        for w in held:
            for k in [k for k in w if k <= self.last_closed]:
                del w[k]
        return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 12), st.booleans(), st.integers(0, 4)), max_size=80))
def test_cluster_windows_fast_path_agrees_with_the_definition(ops: list[tuple[int, int, bool, int]]) -> None:
    """Windows arrive from 5 nodes in any order (restarts, gaps, late arrivals) while nodes die and return:
    the fast path closes exactly what looking at every live node closes."""
    cw, ref = ClusterWindows(keep=4), _ReferenceClusterWindows(keep=4)
    nodes = [f"n{i}" for i in range(5)]
    dead: set[str] = set()
    for node_i, seq, toggle, dead_i in ops:
        if toggle:
            dead ^= {nodes[dead_i]}
        n = nodes[node_i]
        c = np.full((2, 2), node_i + 1, np.uint32)
        cw.add(n, seq, c)
        ref.add(n, seq, c)
        live = [x for x in nodes if x not in dead] or nodes[:1]
        got = [(k, int(t.sum())) for k, t, _, _ in cw.ready(live)]
        assert got == ref.ready(live)
