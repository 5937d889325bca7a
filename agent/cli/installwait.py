"""After a commit, wait until the engines run it: `emoe drain`, `emoe restore` and `emoe propose --wait`.

A commit is the agents' decision; an engine rank installs it at a step boundary once every EP rank holds it,
and says which version it runs in every load report to its own node's agent (agent/link/installs.py). So the
CLI asks each alive member's agent for its Status (the asked agent's own reply, then every other alive
member at its gossip address) and waits until each rank that is active in that agent's committed table and
whose engine has reported a version runs `version` or newer. A rank with no engine attached (no report of a
version yet: the engine is not started, or its plugin predates version reports; or one whose link is closed
and whose last report is older than the agent's install-lag bound: it is gone, as after `emoe load replay`
ended) is not waited for; it is counted and named. A member that is suspect, dead or has left is not asked (its ranks are being repaired);
an alive member that does not answer keeps the wait open, and is named if the wait times out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import gossip_pb2 as gpb

ASK_TIMEOUT_S = 2.0


@dataclass
class InstallState:
    """Where the engines stand on `version`: ranks that run it, ranks that do not yet, and what is unknown."""

    version: int
    installed: list[tuple[str, int, int]] = field(default_factory=list)   # (node, rank, version it runs)
    behind: list[tuple[str, int, int]] = field(default_factory=list)
    no_engine: list[tuple[str, int]] = field(default_factory=list)        # active, no version reported
    unanswered: list[str] = field(default_factory=list)                   # "node at address: why"

    @property
    def done(self) -> bool:
        return not self.behind and not self.unanswered

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "done": self.done,
                "installed": [{"node": n, "rank": r, "installed_version": v} for n, r, v in self.installed],
                "behind": [{"node": n, "rank": r, "installed_version": v} for n, r, v in self.behind],
                "no_engine": [{"node": n, "rank": r} for n, r in self.no_engine], "unanswered": self.unanswered}

    def summary(self) -> str:
        s = f"version {self.version} runs on {len(self.installed)} engine rank(s)"
        if self.no_engine:
            s += f"; no engine attached on rank(s) {', '.join(str(r) for _, r in sorted(self.no_engine, key=_rk))}"
        return s

    def failure(self, waited_s: float) -> str:
        parts = [f"rank {r} (on {n}) runs version {v}" for n, r, v in sorted(self.behind, key=lambda x: x[1])]
        parts += [f"agent {u}" for u in self.unanswered]
        return (f"version {self.version} is committed but not installed after {waited_s:.1f} s: "
                + "; ".join(parts))


def _rk(x: tuple[str, int]) -> int:
    return x[1]


def tally(version: int, replies: list[apb.StatusReply], unanswered: list[str]) -> InstallState:
    """The install state of `version` over the members' Status replies (pure)."""
    st = InstallState(version, unanswered=list(unanswered))
    for rep in replies:
        for i in rep.ranks:
            if not i.active:
                continue
            if not i.installed_version or (not i.attached and i.report_age_s > rep.install_lag_bound_s):
                st.no_engine.append((rep.node_id, i.rank))
            elif i.installed_version >= version:
                st.installed.append((rep.node_id, i.rank, i.installed_version))
            else:
                st.behind.append((rep.node_id, i.rank, i.installed_version))
    return st


def ask_members(first: apb.StatusReply, ask: Callable[[str], apb.StatusReply]) -> tuple[list[apb.StatusReply], list[str]]:
    """`first` (the asked agent's own reply) and the Status of every other alive member, asked at its address;
    and the alive members that did not answer ("node at address: why")."""
    replies, unanswered = [first], []
    for m in sorted(first.members, key=lambda m: m.node_id):
        if m.node_id == first.node_id or m.status != gpb.ALIVE:
            continue
        try:
            replies.append(ask(m.address))
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            unanswered.append(f"{m.node_id} at {m.address}: {code.name.lower() if code else e}")
    return replies, unanswered


def wait_installed(status: Callable[[], apb.StatusReply], ask: Callable[[str], apb.StatusReply], version: int,
                   timeout_s: float | None, poll_s: float = 0.2,
                   now: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                   ) -> tuple[InstallState, float]:
    """Poll until every active engine rank runs `version` (or newer), or `timeout_s` passes (None: the asked
    agent's engine.install_lag_s, the bound past which `emoe status` flags a rank). Returns the last state
    and the seconds waited."""
    t0 = now()
    while True:
        first = status()
        limit = first.install_lag_bound_s if timeout_s is None else timeout_s
        st = tally(version, *ask_members(first, ask))
        waited = now() - t0
        if st.done or waited >= limit:
            return st, waited
        sleep(min(poll_s, max(0.0, limit - waited)))
