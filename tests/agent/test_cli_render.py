"""What the read commands print (issue 33): commit times as UTC wall-clock, nodes by their ids, "-" before any
load window, long operation lists summarised (the full list behind --verbose)."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from agent.admin.admin import copy_bytes, rank_nodes
from agent.cli import render
from controlplane.table import copied_slots, diff, initial_table
from controlplane.topology import Topology
from elasticmoe.codec import table_to_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb

MIGRATIONS = [cpb.Operation(kind=cpb.MIGRATE, layer=lay, experts=[27 + k], src=5, dst=[4, 7, 1, 2, 8][k], rank=-1,
                            source=-1) for lay in range(26) for k in range(5)]


def test_history_shows_the_commit_time_in_utc(capsys: pytest.CaptureFixture[str]) -> None:
    at = int(dt.datetime(2025, 12, 5, 17, 39, 2, tzinfo=dt.UTC).timestamp() * 1000)
    op = cpb.Operation(kind=cpb.REPLICATE, layer=1, experts=[3], dst=0, src=-1, rank=-1, source=-1)
    entries = [apb.HistoryEntry(version=3, parent=2, proposer="node1", committed_at_ms=620_000,
                                committed_at_unix_ms=at, plan=cpb.Plan(ops=[op])),
               apb.HistoryEntry(version=2, parent=1, proposer="node2", committed_at_ms=610_000,
                                plan=cpb.Plan(ops=[op]))]
    render.history(apb.HistoryReply(entries=entries))
    out = capsys.readouterr().out.splitlines()
    assert "v3  parent 2  2025-12-05T17:39:02Z  proposer node1" in out[0]
    assert "v2  parent 1  -  proposer node2" in out[2]  # committed before the time was recorded: not invented
    assert "00:10:" not in "\n".join(out)  # the monotonic field is never shown as a time of day


def test_long_operation_lists_are_summarised(capsys: pytest.CaptureFixture[str]) -> None:
    entry = apb.HistoryEntry(version=7, parent=6, proposer="node1", committed_at_unix_ms=1, copy_bytes=2_000_000,
                             plan=cpb.Plan(ops=MIGRATIONS))
    render.history(apb.HistoryReply(entries=[entry]))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3, out
    assert out[1] == "    130 operations: 130 migrate; copies 2.0 MB; ranks touched: 1-2, 4-5, 7-8"
    assert out[2].count("migrate") == 3 and "--verbose lists all 130" in out[2]
    render.history(apb.HistoryReply(entries=[entry]), verbose=True)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 131 and out[1] == "    migrate L0 E27 r5 -> r4"
    short = apb.HistoryEntry(version=8, parent=7, plan=cpb.Plan(ops=MIGRATIONS[:2]))
    render.history(apb.HistoryReply(entries=[short]))
    assert capsys.readouterr().out.splitlines()[1] == "    migrate L0 E27 r5 -> r4; migrate L0 E28 r5 -> r7"


def test_explain_summarises_chosen_and_refused(capsys: pytest.CaptureFixture[str]) -> None:
    refused = [apb.Candidate(op=MIGRATIONS[i], reason=("NO_GAIN", "GAIN_BELOW_TAU")[i % 2], gain=i / 1000, cost=0.1)
               for i in range(100)]
    trigger = "manual: operator proposal (forced): " + "; ".join(["migrate L0 E27 r5 -> r4"] * 130)
    r = apb.ExplainReply(version=7, trigger=trigger, plan=cpb.Plan(ops=MIGRATIONS), refused=refused,
                         votes=[cpb.Vote(voter="node1", accept=True)], outcome="committed")
    render.explain(r)
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 30, out
    assert "chosen: 130 operations: 130 migrate" in out and "--verbose lists all 130" in out
    assert "not taken: 100 candidates: 50 GAIN_BELOW_TAU, 50 NO_GAIN" in out
    assert "+0.0990" in out and "+0.0010" not in out  # the highest gains are the ones shown
    assert "(--verbose: all" in out and len(max(out.splitlines(), key=len)) < 400
    render.explain(r, verbose=True)
    out = capsys.readouterr().out
    assert out.count("migrate L") > 230 and "+0.0010" in out


def test_no_window_yet_is_a_dash(capsys: pytest.CaptureFixture[str]) -> None:
    s = apb.StatusReply(node_id="node1", committed_version=1, health="SERVING")
    render.status(s)
    head = capsys.readouterr().out.splitlines()[0]
    assert "step imbalance -" in head and "window -" in head and "0.000" not in head
    render.top(s, apb.LoadViewReply(layers=2, experts=4), apb.HistoryReply(), clear=False)
    assert "step imbalance -" in capsys.readouterr().out
    s.step_imbalance, s.window_seq = 1.25, 0  # window 0 closed
    render.status(s)
    head = capsys.readouterr().out.splitlines()[0]
    assert "step imbalance 1.250" in head and "window 0" in head


def test_placement_names_nodes_as_status_does(capsys: pytest.CaptureFixture[str]) -> None:
    topo = Topology(3, 2, 2)
    members = [gpb.MemberState(node_id=n, ranks=[2 * i, 2 * i + 1]) for i, n in enumerate(["node1", "node2", "node3"])]
    names = rank_nodes(members[:2], topo.ranks)
    assert names == ["node1", "node1", "node2", "node2", "", ""]  # node3 not known yet
    r = apb.PlacementReply(table=table_to_pb(initial_table(topo, 1, 4)), ranks_per_node=2,
                           rank_nodes=rank_nodes(members, topo.ranks))
    render.placement(r, 0)
    out = capsys.readouterr().out
    assert all(n in out for n in ("node1", "node2", "node3")) and " n0 " not in out and " n1 " not in out
    assert render.placement_json(r, 0)["rank_nodes"] == ["node1", "node1", "node2", "node2", "node3", "node3"]
    r.ClearField("rank_nodes")  # an agent that does not say: unknown, not a made-up name
    assert render.rank_nodes(r) == ["?"] * 6


def test_copy_bytes_count_the_copied_slots_as_diff_does() -> None:
    topo = Topology(2, 2, 3)
    a = initial_table(topo, 2, 8)
    phy = a.phy2log.copy()
    phy[0, 2], phy[1, 5], phy[1, 0] = 7, 0, -1  # two copies (a slot that empties copies nothing)
    b = a.successor(phy)
    assert copied_slots(a.phy2log, b.phy2log) == len(diff(a, b, 1).moves) == 2
    cb = cpb.Commit(table=table_to_pb(b))
    assert copy_bytes(a.phy2log, cb, 100) == 200
    assert copy_bytes(None, cb, 100) == 0 and copy_bytes(a.phy2log[:1], cb, 100) == 0  # parent unknown
    assert np.array_equal(a.phy2log, initial_table(topo, 2, 8).phy2log)
