"""Invariant checks on a recorded consensus history (chaos.quorumsim.HistoryEvent).

- I1 at most one table is chosen for any version: no two tables are each accepted by a quorum of voters
  at one ballot, and every install and every successful proposal agree;
- I2 each node's installed versions strictly increase, each table's parent being the previous version
  (a restarted node continues from the head it recovered);
- I3 every installed table is valid;
- I7 nothing a node installed is missing after its restart (the store kept it);
- linearizability of the version register (Wing & Gong's search, per version: P-compositionality):
  each version is a write-once register; a proposal is a write(table) that either succeeded, failed
  because another table was chosen, or is unknown (it may take effect at any point, or never); each
  install is a read of that version at one instant. Real-time order is the history's sequence numbers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from chaos.quorumsim import HistoryEvent


@dataclass(frozen=True)
class Op:
    """One register operation: kind "write" (result "ok" | "fail" | "unknown") or "read"."""

    kind: str
    value: bytes
    invoke: float
    response: float
    result: str = "ok"
    name: str = ""


def _step(state: bytes | None, op: Op) -> tuple[bool, bytes | None]:
    """The write-once register: (is `op` legal from `state`, the state after it)."""
    if op.kind == "read":
        return state == op.value, state
    if op.result == "fail":  # the proposer learned that another table was chosen
        return state is not None and state != op.value, state
    if op.result == "ok":
        if state is None:
            return True, op.value
        return state == op.value, state
    # unknown: if it takes effect it behaves as a write that succeeded on an empty register
    if state is None:
        return True, op.value
    return state == op.value, state


def linearizable(ops: list[Op], max_states: int = 200_000) -> bool:
    """Wing-Gong: is there a total order of `ops` that respects real time and the register's semantics?
    Unknown writes may also be left out. Memoized on (set of linearized ops, state)."""
    ops = sorted(ops, key=lambda o: (o.invoke, o.response))
    n = len(ops)
    required = frozenset(i for i, o in enumerate(ops) if o.result != "unknown" or o.kind == "read")
    seen: set[tuple[frozenset[int], bytes | None]] = set()
    stack: list[tuple[frozenset[int], bytes | None]] = [(frozenset(), None)]
    while stack:
        done, state = stack.pop()
        if required <= done:
            return True
        if (done, state) in seen:
            continue
        seen.add((done, state))
        if len(seen) > max_states:
            raise RuntimeError(f"linearizability search exceeded {max_states} states on {n} operations")
        # an op may go next only if no pending required op responded before it was invoked
        horizon = min((ops[i].response for i in range(n) if i not in done and i in required), default=math.inf)
        for i in range(n):
            if i in done or ops[i].invoke > horizon:
                continue
            ok, nxt = _step(state, ops[i])
            if ok:
                stack.append((done | {i}, nxt))
    return False


def write_once_linearizable(ops: list[Op]) -> bool:
    """The same answer as `linearizable` for this register, in closed form (large histories: 64 nodes that
    all propose one version give hundreds of operations, beyond the search). The register is first set by
    the write of the chosen value c with the earliest invoke t_c; every op that observes it set (a read, a
    successful write, a failed write) must respond at or after t_c; reads and successful writes all carry
    c, failed writes never do."""
    observers = [o for o in ops if o.kind == "read" or o.result in ("ok", "fail")]
    fixed = {o.value for o in ops if o.kind == "read" or (o.kind == "write" and o.result == "ok")}
    if len(fixed) > 1:
        return False
    candidates = fixed or {o.value for o in ops if o.kind == "write" and o.result != "fail"}
    if not observers:
        return True
    for c in candidates:
        if any(o.kind == "write" and o.result == "fail" and o.value == c for o in ops):
            continue
        t_c = min((o.invoke for o in ops if o.kind == "write" and o.result != "fail" and o.value == c),
                  default=math.inf)
        if all(o.response >= t_c for o in observers):
            return True
    return False


def register_ops(history: Iterable[HistoryEvent]) -> dict[int, list[Op]]:
    """Per version: writes from invoke/respond pairs, reads from installs."""
    by_version: dict[int, list[Op]] = defaultdict(list)
    invokes: dict[int, HistoryEvent] = {}
    responses: dict[int, HistoryEvent] = {}
    for e in history:
        if e.kind == "invoke":
            invokes[e.op] = e
        elif e.kind == "respond":
            responses[e.op] = e
        elif e.kind == "install":
            by_version[e.version].append(Op("read", e.digest, e.seq, e.seq, "ok", f"{e.node}@{e.seq}"))
    for op_id, inv in invokes.items():
        r = responses.get(op_id)
        result = r.result if r is not None else "unknown"
        resp = r.seq if r is not None and result != "unknown" else math.inf
        by_version[inv.version].append(Op("write", inv.digest, inv.seq, resp, result, f"{inv.node}#{op_id}"))
    return by_version


def check(history: list[HistoryEvent]) -> list[str]:
    """All violations found in `history`, each naming the invariant, node and version."""
    out: list[str] = []
    chosen: dict[int, bytes] = {}
    last: dict[str, int] = {}
    had: dict[str, tuple[int, ...]] = {}
    votes: dict[tuple[int, tuple[int, str], bytes], set[str]] = defaultdict(set)
    quorum_chose: dict[int, bytes] = {}
    for e in history:
        if e.kind == "accept":
            key = (e.version, e.ballot, e.digest)
            votes[key].add(e.node)
            if len(votes[key]) == e.quorum:  # reported once, when this ballot's quorum forms
                prev = quorum_chose.setdefault(e.version, e.digest)
                if prev != e.digest:
                    out.append(f"I1: version {e.version}: quorums chose {prev.hex()[:8]} and {e.digest.hex()[:8]} "
                               f"(ballot {e.ballot})")
        elif e.kind == "install":
            prev = chosen.setdefault(e.version, e.digest)
            if prev != e.digest:
                out.append(f"I1: version {e.version} installed as {prev.hex()[:8]} and as {e.digest.hex()[:8]} (at {e.node})")
            if e.node in last and (e.version <= last[e.node] or (e.parent != last[e.node] and not e.snapshot)):
                out.append(f"I2: {e.node} installed version {e.version} (parent {e.parent}) after {last[e.node]}")
            last[e.node] = e.version
            if not e.valid:
                out.append(f"I3: {e.node} installed an invalid table for version {e.version}")
        elif e.kind == "respond" and e.result == "ok":
            prev = chosen.setdefault(e.version, e.digest)
            if prev != e.digest:
                out.append(f"I1: version {e.version} reported committed as {e.digest.hex()[:8]}, chosen {prev.hex()[:8]}")
        elif e.kind == "crash":
            had[e.node] = e.versions
        elif e.kind == "wipe":  # the node's store was lost: it rebuilds from genesis, nothing to recover
            had[e.node] = ()
            last.pop(e.node, None)
        elif e.kind == "cut":  # its log lost its last records: it recovers what is left, then rebuilds
            had[e.node] = e.versions
            if e.versions:
                last[e.node] = max(e.versions)
            else:
                last.pop(e.node, None)
        elif e.kind == "recover":
            lost = sorted(set(had.get(e.node, ())) - set(e.versions))
            if lost:
                out.append(f"I7: {e.node} lost committed versions {lost} across restart")
            if e.node in last and e.version < last[e.node]:
                out.append(f"I7: {e.node} recovered head {e.version} below its installed {last[e.node]}")
            last[e.node] = e.version
    for v, ops in sorted(register_ops(history).items()):
        if not (linearizable(ops) if len(ops) <= 12 else write_once_linearizable(ops)):
            desc = ", ".join(f"{o.kind}:{o.name}:{o.value.hex()[:6]}:{o.result}" for o in ops[:8])
            out.append(f"linearizability: version {v} register history has no linearization ({desc})")
    return out
