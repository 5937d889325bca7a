"""When a computed plan may still be proposed (controlplane.requests.stale), kind by kind, and what a request
refuses to be built as."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.errors import ControlPlaneError
from controlplane.monitor import ReplayBuffer
from controlplane.params import DecisionParams
from controlplane.requests import PlanRequest, stale
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology

HEAD = initial_table(Topology(2, 2, 5), 2, 8)
PARENT = initial_table(Topology(2, 2, 5), 2, 8)


def req(kind: str, lost: tuple[int, ...] = (), target: RoutingTable | None = None) -> PlanRequest:
    return PlanRequest(3, HEAD, ReplayBuffer(2, 8, 1), DecisionParams(), None, np.zeros((2, 8), dtype=bool),
                       "t", False, 1.2, kind, lost, target, 2 if target is not None else None)


def now(head: int = HEAD.version, inflight: int | None = None, paused: bool = False, observing: bool = False,
        lost: tuple[int, ...] = (), due: RoutingTable | None = None) -> dict[str, object]:
    return {"head": head, "inflight": inflight, "paused": paused, "observing": observing, "lost": lost, "due": due}


@pytest.mark.parametrize(("request_", "state", "why"), [
    # every kind: the head moved, or a proposal went out meanwhile
    *[(req(k, target=PARENT if k == "rollback" else None), now(head=HEAD.version + 1), f"head moved to v{HEAD.version + 1}")
      for k in ("rebalance", "repair", "rollback", "fill")],
    *[(req(k, target=PARENT if k == "rollback" else None), now(inflight=1), "v1 was proposed meanwhile")
      for k in ("rebalance", "repair", "rollback", "fill")],
    # a rebalance: ranks lost (their repair first), paused, a change under observation
    (req("rebalance"), now(lost=(3,)), "ranks [3] were lost meanwhile"),
    (req("rebalance"), now(paused=True), "paused"),
    (req("rebalance"), now(observing=True), "under observation"),
    (req("rebalance"), now(), ""),
    # a repair or a fill: the lost ranks changed; a pause does not hold either
    (req("repair", (3,)), now(lost=(3, 5)), "the lost ranks are [3, 5] now"),
    (req("repair", (3,)), now(lost=(3,), paused=True, observing=True), ""),
    (req("fill"), now(lost=(2,)), "the lost ranks are [2] now"),
    (req("fill"), now(paused=True), ""),
    # a rollback: still due to the same target
    (req("rollback", target=PARENT), now(due=None), "no longer due"),
    (req("rollback", target=PARENT), now(due=HEAD), "no longer due"),  # another change's rollback is due now
    (req("rollback", target=PARENT), now(due=PARENT, paused=True), ""),
])
def test_when_a_plan_is_stale(request_: PlanRequest, state: dict[str, object], why: str) -> None:
    got = stale(request_, **state)  # type: ignore[arg-type]
    assert (got == "") if not why else why in got, (request_.kind, state, got)


def test_a_request_names_a_kind_it_knows_and_a_target_exactly_for_a_rollback() -> None:
    for kind, target in (("rebalanse", None), ("rollback", None), ("repair", PARENT)):
        with pytest.raises(ControlPlaneError, match="plan request of kind"):
            req(kind, target=target)
