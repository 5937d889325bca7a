"""agent.link.installs: each rank's installed version from its reports, and the lag watchdog at its bound."""

from __future__ import annotations

import pytest

from agent.link.installs import Installs

BOUND = 5.0


def installs() -> Installs:
    ins = Installs([0, 1, 2], BOUND)
    ins.committed(1, 0.0)
    return ins


def test_a_rank_at_the_head_never_lags() -> None:
    ins = installs()
    ins.reported(0, 1, 0.0)
    assert ins.lagging(1, 1000.0) == [] and ins.lag_s(0, 1, 1000.0) == 0.0


def test_lag_counts_from_the_commit_of_the_first_newer_version_and_flags_past_the_bound() -> None:
    ins = installs()
    ins.reported(0, 1, 0.5)
    ins.reported(1, 1, 0.5)
    ins.committed(2, 10.0)
    ins.reported(1, 2, 11.0)  # rank 1 installs v2 a second later; rank 0 stays on v1
    assert ins.lag_s(0, 2, 10.0 + BOUND) == BOUND
    assert ins.lagging(2, 10.0 + BOUND) == []  # at the bound: not yet
    assert ins.lagging(2, 10.0 + BOUND + 0.01) == [0]
    assert ins.lag_s(1, 2, 100.0) == 0.0


def test_later_commits_do_not_reset_the_clock_of_a_stuck_rank() -> None:
    ins = installs()
    ins.reported(0, 1, 0.0)
    for v in range(2, 10):  # a commit every second, none installed
        ins.committed(v, float(v))
    assert ins.lag_s(0, 9, 9.0) == 7.0 and ins.lagging(9, 9.0) == [0]


def test_a_rank_that_installs_late_lags_from_its_install_not_from_the_old_commit() -> None:
    ins = installs()
    ins.committed(2, 1.0)
    ins.committed(3, 2.0)
    ins.reported(0, 2, 20.0)  # it installed v2 at 20, when v3 was long committed
    assert ins.lag_s(0, 3, 24.0) == 4.0 and ins.lagging(3, 24.0) == []
    assert ins.lagging(3, 25.5) == [0]


def test_version_zero_reports_count_as_reports_not_installs_and_other_ranks_are_ignored() -> None:
    ins = installs()
    ins.reported(2, 0, 3.0)
    ins.reported(7, 1, 3.0)  # another node's rank
    ins.committed(2, 4.0)
    assert ins.last_report(2) == 3.0 and ins.installed(2) == 0 and ins.last_report(7) is None
    assert ins.lagging(2, 100.0) == []  # never said what it runs: nothing to wait for or flag
    v = {i.rank: i for i in ins.view(2, 10.0)}
    assert v[2].installed == 0 and v[2].installed_age_s == -1.0 and v[2].report_age_s == 7.0
    assert v[0].report_age_s == -1.0 and sorted(v) == [0, 1, 2]


def test_view_ages_and_forget() -> None:
    ins = installs()
    ins.reported(0, 1, 1.0)
    ins.reported(0, 1, 3.0)  # the same version again: its age runs on from the first report of it
    ins.committed(2, 4.0)
    i0 = ins.view(2, 12.0)[0]
    assert (i0.installed, i0.installed_age_s, i0.report_age_s, i0.lag_s, i0.lagging) == (1, 11.0, 9.0, 8.0, True)
    ins.forget([0])  # its process left
    assert ins.installed(0) == 0 and ins.lagging(2, 12.0) == []


def test_each_stuck_version_is_announced_once() -> None:
    ins = installs()
    ins.reported(0, 1, 0.0)
    ins.committed(2, 1.0)
    assert ins.newly_lagging(2, 7.0) == [(0, 1, 6.0)]
    assert ins.newly_lagging(2, 8.0) == []
    ins.reported(0, 2, 9.0)
    ins.committed(3, 10.0)
    assert [r for r, *_ in ins.newly_lagging(3, 16.0)] == [0]


def test_a_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="bound_s"):
        Installs([0], 0.0)


def test_the_cli_waits_for_active_ranks_that_reported_and_names_the_rest() -> None:
    from agent.cli.installwait import tally
    from agent.cli.render import rank_state
    from elasticmoe.v1 import admin_pb2 as apb

    def rep(node: str, *ranks: apb.RankInstall) -> apb.StatusReply:
        return apb.StatusReply(node_id=node, committed_version=4, ranks=list(ranks), install_lag_bound_s=BOUND)

    a = rep("n1", apb.RankInstall(rank=0, installed_version=4, active=True),
            apb.RankInstall(rank=1, installed_version=3, active=True, lag_s=9.0, lagging=True))
    b = rep("n2", apb.RankInstall(rank=2, active=True, report_age_s=-1, installed_age_s=-1),  # no engine: not waited
            apb.RankInstall(rank=3, installed_version=2, active=False))  # drained: not waited for
    st = tally(4, [a, b], [])
    assert not st.done and st.behind == [("n1", 1, 3)] and st.no_engine == [("n2", 2)]
    assert "rank 1 (on n1) runs version 3" in st.failure(5.0) and "rank 2" not in st.failure(5.0)
    assert tally(3, [a, b], []).done and not tally(3, [a, b], ["n3 at x:1: unavailable"]).done
    assert rank_state(a, a.ranks[1]) == "LAGGING 9.0 s" and rank_state(b, b.ranks[0]) == "no engine attached"


def test_a_rank_whose_link_closed_and_reports_stopped_is_not_waited_for() -> None:
    """After `emoe load replay` ended (its links claim no rank), or an engine that left without its link
    saying so: a last report older than the bound, link closed: no engine there now (issue 33)."""
    from agent.cli.installwait import tally
    from agent.cli.render import rank_state
    from elasticmoe.v1 import admin_pb2 as apb

    gone = apb.RankInstall(rank=0, installed_version=2, active=True, attached=False, report_age_s=BOUND + 1)
    fresh = apb.RankInstall(rank=1, installed_version=2, active=True, attached=False, report_age_s=0.5)
    held = apb.RankInstall(rank=2, installed_version=2, active=True, attached=True, report_age_s=BOUND + 1)
    r = apb.StatusReply(node_id="n1", committed_version=3, ranks=[gone, fresh, held], install_lag_bound_s=BOUND)
    st = tally(3, [r], [])
    assert st.no_engine == [("n1", 0)] and st.behind == [("n1", 1, 2), ("n1", 2, 2)]
    assert rank_state(r, gone).startswith("no engine attached (last report")
