"""Exhaustive check of rebuild after store loss plus Paxos, in the manner of a model checker.

    python -m chaos.modelcheck                   # the full bound (see below for its cost)
    python -m chaos.modelcheck --proposals 1     # a smaller one
    python -m chaos.modelcheck --mutant          # the rebuild before the fix: must find I1 broken

It drives the shipped ConsensusNode (Paxos, rebuild, store, catch-up) on chaos/mcworld.py's scheduler
transport and clock, and visits EVERY state reachable in a bounded scenario: three voters that found a new
cluster from empty stores (genesis v1), client proposals of distinct tables for v2 and v3, one crash (the node
restarts from its store), one wiped data_dir (the node restarts with an empty store and no marker, so
had_store is False), every order of message deliveries (a message may also be lost by reaching a node that
is down), and every order of timers (takeover, ballot retry and timeout, thrifty second wave, rebuild retry,
each call's deadline). In every state it checks I1: at most one table chosen for each version, counting
tables committed anywhere, reported committed to a client, or durably accepted by a quorum at one ballot.

Search: depth-first over events, with a visited set of canonical state digests (chaos/mccanon.py), each state
copied whole before each of its events. The exploration is complete for the bound when it ends without
hitting `--max-states`. Bounds: `--proposals`, `--fires` (takeover, ballot and rebuild timers fired, in all:
without a bound two recovering voters could duel with ever higher rounds), `--max-attempts` (the node's own
ballot limit per proposal), `--crashes`, `--wipes`. Sync (anti-entropy) is off: it only makes nodes learn
commits sooner, as the catch-up a reply triggers already does.

Calls end by their reply only unless `--call-timeouts` (a deadline's only effects are on liveness: which
peer a later catch-up asks, and the thrifty second wave, which its own timer also sends).

Measured on this project's 2-core machine (about 350 states a second):
- `--founded --proposals 1 --crashes 0 --wipes 0 --fires 0`: 102 states, complete, 0.7 s;
- `--hazard --fires 0` (the scripted hazard, then every continuation: one more crash budget is spent, n2
  may restart): 1847 states, 5091 transitions, complete, no violation, about 8 s; with `--mutant`: I1 broken
  after 13 events (the trace goes to stderr), 0.04 s;
- the full bound (the defaults: from the boot, founding included) did NOT complete in 10 minutes (over 200k
  states; a wipe alone multiplies the one-proposal space of 102 states past 8000 before it ends); it needs
  partial-order reduction (deliveries to different nodes commute) before it is practical.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import agent.consensus.recovery as recovery_mod
from agent.consensus.rebuild import Rebuild
from chaos.mccanon import fingerprint, snapshot
from chaos.mcworld import Bound, World

# The hazard the fix is about, scripted up to the point where a second table could be chosen for v2: n2 (v2's
# round-0 owner) proposes X and n0 accepts it (X is chosen); n0 loses its whole data_dir and restarts; n1,
# which never heard of X, answers n0's enrolment; n2 crashes; n1 proposes Y. Every continuation is explored.
HAZARD = (("propose", "n2"), ("msg", "n2->n0 Accept"), ("wipe", "n0"), ("restart", "n0"),
          ("msg", "n0->n1 CatchUp"), ("msg", "reply n1->n0 CatchUp"), ("crash", "n2"), ("propose", "n1"))

@dataclass
class Report:
    bound: dict[str, object]
    states: int = 0
    transitions: int = 0
    quiescent: int = 0  # states in which nothing more can happen: the ends of maximal executions
    depth: int = 0
    complete: bool = True
    elapsed_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)


@dataclass
class _Frame:
    world: World
    choices: list[tuple[str, int | str]]
    line: str
    i: int = 0


def explore(bound: Bound, max_states: int = 0, stop_at_first: bool = True,
            prefix: tuple[tuple[str, str], ...] = ()) -> Report:
    """Visit every state reachable under `bound` (after the events of `prefix`, see World.find); stop at the
    first I1 violation (its trace in the report)."""
    t0 = time.perf_counter()
    rep = Report(asdict(bound))
    root = World(bound)
    head = [root.do(*root.find(kind, what)) for kind, what in prefix]
    visited = {fingerprint(root)}
    rep.states = 1
    stack = [_Frame(root, root.choices(), "\n".join(head))]
    while stack:
        fr = stack[-1]
        if fr.i >= len(fr.choices):
            if not fr.choices:
                rep.quiescent += 1
            stack.pop()
            continue
        kind, arg = fr.choices[fr.i]
        fr.i += 1
        w = fr.world if fr.i == len(fr.choices) else snapshot(fr.world)  # the last event may use the frame's own
        line = w.do(kind, arg)
        rep.transitions += 1
        fp = fingerprint(w)
        if fp in visited:
            continue
        visited.add(fp)
        rep.states += 1
        rep.depth = max(rep.depth, len(stack))
        bad = w.violations()
        if bad:
            rep.violations += bad
            if not rep.trace:
                rep.trace = [ln for f in stack for ln in f.line.split("\n") if ln] + [line]
            if stop_at_first:
                rep.complete = False
                break
            continue
        if max_states and rep.states >= max_states:
            rep.complete = False
            break
        stack.append(_Frame(w, w.choices(), line))
    rep.elapsed_s = round(time.perf_counter() - t0, 2)
    return rep


class FirstAnswerRebuild(Rebuild):
    """The rebuild before the fix (ec7b6b8): a node whose data_dir looks new (had_store False) decides at the
    first answer: one showing history makes it strict, one showing a new cluster lets it vote at once."""

    def report(self, peer: str, head: int, acceptor_high: int, rebuilding: bool, knew_you: bool = False) -> None:
        if peer not in self.others or self.decided:
            return
        high = max(head, acceptor_high)
        if high > self.genesis:
            self.strict = True
        elif not self.strict:
            self.abstain_through = 0
            return
        if not rebuilding:
            self.reports[peer] = high
        if self.strict and len(self.reports) >= self.need:
            self.abstain_through = max(self.reports.values()) + 1


@contextmanager
def mutant() -> Iterator[None]:
    """Run the nodes with the rebuild as it was before the fix."""
    old = recovery_mod.Rebuild  # type: ignore[attr-defined]
    recovery_mod.Rebuild = FirstAnswerRebuild  # type: ignore[attr-defined]
    try:
        yield
    finally:
        recovery_mod.Rebuild = old  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.modelcheck", description=__doc__.split("\n")[0])
    d = Bound()
    ap.add_argument("--proposals", type=int, default=d.proposals)
    ap.add_argument("--fires", type=int, default=d.fires)
    ap.add_argument("--max-attempts", type=int, default=d.max_attempts)
    ap.add_argument("--crashes", type=int, default=d.crashes)
    ap.add_argument("--wipes", type=int, default=d.wipes)
    ap.add_argument("--thrifty-ms", type=int, default=d.thrifty_ms)
    ap.add_argument("--call-timeouts", action="store_true", help="a call's deadline is a timer too")
    ap.add_argument("--founded", action="store_true", help="start once the founders decided (one order)")
    ap.add_argument("--max-states", type=int, default=0, help="stop after this many states (0: no limit)")
    ap.add_argument("--mutant", action="store_true", help="the rebuild before the fix (must find I1 broken)")
    ap.add_argument("--hazard", action="store_true", help="start from the scripted hazard (HAZARD), founded")
    a = ap.parse_args(argv)
    bound = Bound(proposals=a.proposals, fires=a.fires, max_attempts=a.max_attempts, crashes=a.crashes,
                  wipes=a.wipes, thrifty_ms=a.thrifty_ms, call_timeouts=a.call_timeouts,
                  founded=a.founded or a.hazard)
    prefix = HAZARD if a.hazard else ()
    logging.disable(logging.CRITICAL)  # the nodes' warnings (rebuilding, voting again) at every state
    if a.mutant:
        with mutant():
            rep = explore(bound, a.max_states, prefix=prefix)
    else:
        rep = explore(bound, a.max_states, prefix=prefix)
    for line in rep.trace:
        print(line, file=sys.stderr)
    out = asdict(rep)
    out["violations"] = len(rep.violations)
    out["first_violation"] = rep.violations[0] if rep.violations else ""
    del out["trace"]
    print(json.dumps(out))
    return 1 if rep.violations else 0


if __name__ == "__main__":
    sys.exit(main())
