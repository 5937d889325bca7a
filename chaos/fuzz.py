"""Fuzz every RPC handler with hostile protobufs (Hypothesis; strategies in chaos/protofuzz.py).

    python -m chaos.fuzz --examples 10000 --json

prints `{"examples_per_rpc": N, "rpcs": {NAME: {"examples": n, "crashes": 0, "state_changes_on_reject": 0,
"accepted_hostile": 0, "rejected": r, "accepted": a, "undecodable": u, "seconds": s}}, "failures": {...}}`.
Per example: snapshot the handler's state, call it, snapshot again. A crash is any exception other than the
handler's typed refusal, or a refusal without a reason; a state change on reject is a refused request (or
a query) after which the snapshot differs; `accepted_hostile` counts requests the target's own oracle calls
plainly hostile (unknown ids, wrong shapes, forged certificates, ...) that the handler nevertheless accepted.
An accepted request may change state; the target is then reset.
Bytes that do not parse as the request type never reach the handler (the transport's decoder refuses
them); they are counted in `undecodable`.

The tests run the same loop with `EMOE_FUZZ_EXAMPLES` examples per RPC (default 300), raising on the
first failure so that Hypothesis shrinks it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings

from chaos.fuzz_link import LinkTarget, ShimStoreTarget
from chaos.fuzz_targets import ADMIN_METHODS, AdminTarget, ConsensusTarget, Target
from chaos.protofuzz import hostile


def default_examples() -> int:
    """Examples per RPC in CI: EMOE_FUZZ_EXAMPLES, default 300."""
    raw = os.environ.get("EMOE_FUZZ_EXAMPLES", "300")
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"EMOE_FUZZ_EXAMPLES = {raw!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"EMOE_FUZZ_EXAMPLES = {n}: expected a positive integer")
    return n


@dataclass
class FuzzStats:
    examples: int = 0
    crashes: int = 0
    state_changes_on_reject: int = 0
    accepted_hostile: int = 0  # accepted although the target's oracle calls it plainly hostile
    rejected: int = 0
    accepted: int = 0
    undecodable: int = 0
    failures: list[str] = field(default_factory=list)

    def report(self) -> dict[str, int]:
        d = asdict(self)
        d.pop("failures")
        return d


class FuzzFailure(AssertionError):
    pass


def check_one(target: Target, req: Message | bytes, stats: FuzzStats) -> str:
    """Run one example; returns a failure description, or ""."""
    stats.examples += 1
    if isinstance(req, bytes):
        stats.undecodable += 1
        return ""
    before = target.snapshot()
    hostile_why = target.must_refuse(req)  # judged against the state the request meets
    try:
        verdict = target.call(req)
    except Exception as e:  # anything escaping the handler is a crash
        stats.crashes += 1
        target.fresh()
        return f"crash: {type(e).__name__}: {e} on {type(req).__name__} {req}"[:2000]
    after = target.snapshot()
    if verdict.rejected:
        stats.rejected += 1
        if not verdict.reason:
            stats.crashes += 1
            return f"refusal without a reason on {req}"[:2000]
    else:
        stats.accepted += 1
        if hostile_why:
            stats.accepted_hostile += 1
            target.fresh()
            return f"accepted hostile input ({hostile_why}): {req}"[:2000]
    if (verdict.rejected or verdict.read_only) and after != before:
        stats.state_changes_on_reject += 1
        target.fresh()
        kind = "refused" if verdict.rejected else "read-only"
        return f"state changed by a {kind} request ({verdict.reason}): {req}"[:2000]
    if after != before:
        target.fresh()
    return ""


def fuzz(target: Target, examples: int, *, raise_on_failure: bool = False, seed: int | None = None) -> FuzzStats:
    """Feed `examples` hostile requests to `target`. With raise_on_failure, the first failure raises
    FuzzFailure after Hypothesis has shrunk it; otherwise failures are counted and the run goes on."""
    stats = FuzzStats()
    phases = [Phase.generate, Phase.shrink] if raise_on_failure else [Phase.generate]
    cfg = settings(max_examples=examples, database=None, deadline=None, phases=phases, derandomize=seed is not None,
                   suppress_health_check=list(HealthCheck), print_blob=False)

    @cfg
    @given(hostile(target.request, target.seeds()))
    def run(req: Message | bytes) -> None:
        why = check_one(target, req, stats)
        if why:
            if len(stats.failures) < 5:
                stats.failures.append(why)
            if raise_on_failure:
                raise FuzzFailure(f"{target.name}: {why}")

    run()
    return stats


def factories() -> dict[str, Callable[[asyncio.AbstractEventLoop], Target]]:
    """RPC name -> how to build its target (gossip's once agent/gossip/gossip_node.py serves them)."""
    out: dict[str, Callable[[asyncio.AbstractEventLoop], Target]] = {}
    for m in ("Prepare", "Accept", "Learn", "CatchUp", "ControlAccept", "ControlLearn"):
        out[f"Consensus/{m}"] = lambda loop, m=m: ConsensusTarget(m)
    for m in ADMIN_METHODS:
        out[f"Admin/{m}"] = lambda loop, m=m: AdminTarget(m, loop)
    for m in ("ReportLoad", "WatchTables"):
        out[f"DataplaneLink/{m}"] = lambda loop, m=m: LinkTarget(m, loop)
    out["Shim/OfferCommit"] = lambda loop: ShimStoreTarget()
    try:
        from chaos.fuzz_gossip import gossip_factories
    except ImportError:
        return out
    return {**out, **gossip_factories()}


@contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        loop.close()


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--examples", type=int, default=None, help="examples per RPC (default: EMOE_FUZZ_EXAMPLES or 300)")
    ap.add_argument("--only", default="", help="comma-separated RPC names (e.g. Consensus/Accept)")
    ap.add_argument("--seed", type=int, default=None, help="derandomize Hypothesis")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    n = a.examples if a.examples is not None else default_examples()
    if n < 1:
        ap.error(f"--examples {n}: expected >= 1")
    only = set(filter(None, a.only.split(",")))
    result: dict[str, dict[str, object]] = {}
    failures: dict[str, list[str]] = {}
    with event_loop() as loop:
        names = [n for n in factories() if not only or n in only]
        if only - set(names):
            ap.error(f"--only: unknown RPCs {sorted(only - set(names))}: expected some of {sorted(factories())}")
        for name in names:
            t = factories()[name](loop)
            t0 = time.perf_counter()
            s = fuzz(t, n, seed=a.seed)
            t.close()
            result[t.name] = {**s.report(), "seconds": round(time.perf_counter() - t0, 2)}
            if s.failures:
                failures[t.name] = s.failures
            if not a.json:
                out(f"{t.name:28s} {s.examples:6d} examples  {s.crashes} crashes  {s.state_changes_on_reject} "
                    f"state changes on reject  {s.accepted_hostile} hostile accepted  ({s.rejected} refused)")
    if a.json:
        out(json.dumps({"examples_per_rpc": n, "rpcs": result, "failures": failures}, sort_keys=True))
    bad = any(r["crashes"] or r["state_changes_on_reject"] or r["accepted_hostile"] for r in result.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
