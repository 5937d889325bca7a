"""Checkers for I1-I7 (DESIGN "Invariants") over the history a SimCluster recorded.

- I1, I2, I3, I7 and linearizability of each version's register: chaos/checkers.py on the consensus-level
  events (installs, durable accepts, proposals, crashes and recoveries); a linearizability failure and a
  node's own conflict log count as I1 (two tables for one version).
- I3 also: every committed table is valid (every expert has a replica on an active rank).
- I4 from the shims: a token accepted by a slot whose real memory (written only by the mover) does not
  hold its expert, or a token dispatched to a rank the sender's membership had declared dead.
- I5: each settle() after the faults healed converged (every live agent and shim on one latest version)
  within its bound; the times are reported.
- I6: no committed rebalance had a verified gain below tau; a rebalance whose realised effect over the
  next N fault-free windows is worse than its parent's (by more than `margin`) is superseded (rolled back, or
  replaced by a later commit) within N + `grace` windows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from chaos.checkers import check as consensus_check
from chaos.realised import realised_worse
from chaos.simcluster import CommitRecord, History, WindowRecord
from chaos.simengine import TokenStats
from controlplane.table import RoutingTable

INVARIANTS = ("I1", "I2", "I3", "I4", "I5", "I6", "I7")


@dataclass
class Report:
    violations: dict[str, list[str]] = field(default_factory=lambda: {k: [] for k in INVARIANTS})
    convergence_s: list[float] = field(default_factory=list)
    i6_judged: int = 0

    def counts(self) -> dict[str, int]:
        return {k: len(v) for k, v in self.violations.items()}

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())


def check_consensus(history: History, conflicts: Iterable[str] = ()) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {k: [] for k in INVARIANTS}
    for msg in consensus_check(history.events):
        key = msg.split(":", 1)[0]
        out[key if key in out else "I1"].append(msg)
    out["I1"] += [f"I1 conflict log: {m}" for m in conflicts]
    for v, r in sorted(history.commits.items()):
        if not r.table.is_valid():
            out["I3"].append(f"I3: committed version {v} is not a valid table")
    return out


def check_i4(tokens: TokenStats) -> list[str]:
    out = []
    if tokens.i4:
        out.append(f"I4: {tokens.i4} tokens accepted by slots whose memory does not hold their expert "
                   f"(e.g. {tokens.i4_examples[:2]})")
    if tokens.misrouted:
        out.append(f"I4: {tokens.misrouted} tokens dispatched to ranks the sender had declared dead")
    return out


def check_i5(history: History) -> list[str]:
    return [f"I5: settle #{i} did not converge within its bound" for i, s in enumerate(history.convergence_s)
            if s is None]


def check_i6(history: History, genesis: RoutingTable, tau: float, rollback_windows: int, span: float, *,
             grace: int = 3, margin: float = 0.05, end: float = float("inf")) -> tuple[list[str], int]:
    """(violations, rebalances judged on realised effect). Window seq k holds the engines' steps from k x `span`
    seconds on. A rebalance whose step imbalance over the first `n` windows that began at or after its commit
    is worse than its parent's by more than `margin` must be superseded (rolled back) within `n + grace`
    windows, and at least `grace` windows' time after the n-th closed, unless the load moved meanwhile so that
    over the last `n` windows before that deadline it is no longer worse by `margin`: then rolling it back would
    be the change that replay shows to be worse, which the controller refuses (decision.rollback:
    ROLLBACK_NOT_BETTER) and I6 forbids. A change whose deadline falls after `end` (the time the run stopped) is
    not judged: its rollback was not yet due (seed 1000634: v24 committed at 86.0 s, deadline 93.5 s, the run
    stopped at 91.7 s; replayed further, v25 superseded it at 92.0 s)."""
    out: list[str] = []
    judged = 0
    tables = {genesis.version: genesis, **{v: r.table for v, r in history.commits.items()}}
    wins: list[WindowRecord] = sorted(history.windows.values(), key=lambda w: w.seq)
    commits: list[CommitRecord] = sorted(history.commits.values(), key=lambda r: r.version)
    struck = [t for t, what in history.faults if not what.startswith("shift")]  # load shifts are not faults

    def clean(w: WindowRecord) -> bool:
        """Fault-free from the window's start to its close: no fault in force when it closed (`w.clean`), and
        none struck while it ran (3-node sim, seed 9061029, schedule 1768: a node restarted with a cut log and
        a partition came and healed within windows 5 and 6, which closed clean, in a burst, 3 s late)."""
        return w.clean and not any(w.seq * span - 1e-9 <= t <= w.t for t in struck)

    for r in commits:
        if r.kind != "rebalance":
            continue
        if r.verified_gain < tau - 1e-12:
            out.append(f"I6: version {r.version} committed a rebalance with verified gain {r.verified_gain:.4f} < "
                       f"tau {tau}")
        parent = tables.get(r.parent)
        # judged from the first window that began after the commit, by the engines' steps: the one open at it
        # ran mostly under the parent, on the load the change was planned on; and windows close late when the
        # agents' view stalls (a down, unsuspected node holds them `lag` windows), so the first window to close
        # after a commit may have begun seconds before it (seed 1000010: v21 committed at 75.003 s, during
        # window 75; windows 73-75 closed after it)
        after = [w for w in wins if w.seq * span >= r.t - 1e-9]
        n = rollback_windows
        if parent is None or len(after) < n + grace or not all(clean(w) for w in after[:n + grace]):
            continue  # not enough fault-free windows after it to judge its realised effect
        # `grace` windows to propose and commit after the n observed ones have closed: counted in windows' time,
        # since after a stall the agents' windows close in a burst (seed 1000304's windows 65-67 closed within
        # 10 ms) and a burst leaves no time to commit anything
        deadline = max(after[n + grace - 1].t, after[n - 1].t + grace * span)
        if deadline > end:
            continue  # the run stopped before its rollback was due
        judged += 1
        worse = realised_worse(r.table, parent, [_rows(w) for w in after[:n]], [_rows(w) for w in after[grace:n + grace]],
                               margin)
        # superseded in time: rolled back, or replaced by a later commit (a rebalance planned and verified on the
        # load since counts too: a restart loses a planner's observation of the change, and then a rebalance, not a
        # rollback, is what moves the cluster off it; that rollbacks happen at all the chaos tests assert apart)
        if worse is not None and not any(c.version > r.version and c.t <= deadline for c in commits):
            out.append(worse.message(r.version, n, grace))
    return out, judged


def check_history(history: History, tokens: TokenStats, genesis: RoutingTable, tau: float, rollback_windows: int,
                  span: float, conflicts: Iterable[str] = (), end: float = float("inf")) -> Report:
    rep = Report()
    for k, v in check_consensus(history, conflicts).items():
        rep.violations[k] += v
    rep.violations["I4"] += check_i4(tokens)
    rep.violations["I5"] += check_i5(history)
    i6, rep.i6_judged = check_i6(history, genesis, tau, rollback_windows, span, end=end)
    rep.violations["I6"] += i6
    rep.convergence_s = [s for s in history.convergence_s if s is not None]
    return rep


def check_cluster(c: object) -> Report:
    """check_history for a SimCluster (chaos.simcluster)."""
    from chaos.simcluster import SimCluster

    if not isinstance(c, SimCluster):
        raise TypeError(f"expected a SimCluster, got {type(c).__name__}")
    conflicts = [m for n in c.up() for m in c.states[n].consensus.conflicts]
    d = c.config(c.ids[0]).decision
    return check_history(c.history, c.tokens, c.genesis, d.tau, d.rollback_windows, c.window * c.step_s, conflicts,
                         end=c.clock.now())


def _rows(w: WindowRecord) -> npt.NDArray[np.integer]:
    """What the controllers judged a window on: its rows (the sampled steps), else its total."""
    return w.rows if w.rows is not None else w.total
