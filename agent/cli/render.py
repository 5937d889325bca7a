"""Human renderings (rich) and JSON shapes of admin replies."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from agent.wire import describe_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb

SPARK = "▁▂▃▄▅▆▇█"
SHORT_OPS = 6      # an operation list up to this long is printed whole; a longer one is summarised
FIRST_OPS = 3      # ... with its first few operations
SHORT_REFUSED = 8  # refused candidates shown without --verbose (the highest gains), with counts by reason
TRIGGER_CHARS = 200  # a trigger (a manual one lists its operations) is cut here without --verbose


class _Console(Console):
    def on_broken_pipe(self) -> None:
        """stdout's reader went away: leave it to `agent.cli.main`, as for any other write (rich's own answer
        is exit status 1, where the CLI's is 141)."""
        raise BrokenPipeError


def _console() -> Console:
    return _Console(highlight=False, soft_wrap=True)


def _table(*headers: str, **kw: Any) -> Table:
    """A table whose column names are never shortened ("versi…"): each column is at least as wide as its
    name; the last column takes the remaining width and folds long values."""
    cols = [Column(h, min_width=len(h), no_wrap=i < len(headers) - 1) for i, h in enumerate(headers[:-1])]
    return Table(*cols, Column(headers[-1], min_width=len(headers[-1]), overflow="fold", ratio=1), **kw)


def when(ms: int) -> str:
    """Unix epoch ms as ISO-8601 UTC to the second ("2025-12-05T17:39:02Z"); "-" for 0 (not known)."""
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def imbalance(x: float) -> str:
    """A step imbalance, or "-" before the first load window closed (the replies say 0.0 then; a window's
    own is >= 1.0)."""
    return f"{x:.3f}" if x > 0 else "-"


def size(n: int) -> str:
    """Bytes in decimal units (the agent's commit log says MB alike)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def spans(xs: Iterable[int]) -> str:
    """Sorted integers as ranges: 0-3, 5, 7-8."""
    out: list[tuple[int, int]] = []
    for x in sorted(set(xs)):
        if out and out[-1][1] == x - 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


def _ranks_of(op: cpb.Operation) -> set[int]:
    return {int(g) for g in (op.src, op.dst, op.rank, op.source) if g >= 0}


def op_lines(ops: Sequence[cpb.Operation], copy_bytes: int, verbose: bool) -> list[str]:
    """Lines for a plan's operations: every one of them with `verbose` or when there are at most SHORT_OPS
    (then on one line), else a summary: counts by kind, the weight bytes copied, the ranks touched, and the
    first FIRST_OPS operations."""
    if not ops:
        return ["(no operations)"]
    if verbose:
        return [describe_pb(o) for o in ops]
    copied = f"; copies {size(copy_bytes)}" if copy_bytes else ""
    if len(ops) <= SHORT_OPS:
        return ["; ".join(describe_pb(o) for o in ops) + copied]
    kinds = Counter(cpb.OpKind.Name(o.kind).lower() if o.kind in cpb.OpKind.values() else f"kind {o.kind}"
                    for o in ops)
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
    ranks = set().union(*(_ranks_of(o) for o in ops))
    return [f"{len(ops)} operations: {by_kind}{copied}; ranks touched: {spans(ranks) or '-'}",
            "first: " + "; ".join(describe_pb(o) for o in ops[:FIRST_OPS]) + f"; ... (--verbose lists all {len(ops)})"]


def status(r: apb.StatusReply) -> None:
    c = _console()
    window = str(r.window_seq) if r.step_imbalance > 0 else "-"
    c.print(f"agent [bold]{r.node_id}[/]  committed version [bold]{r.committed_version}[/]  health {r.health}"
            f"  {'[yellow]paused[/]' if r.paused else 'rebalancing on'}  step imbalance {imbalance(r.step_imbalance)}"
            f"  window {window}")
    if r.role and r.role != "voter":
        c.print(f"role: [yellow]{r.role}[/]")
    cluster_lines(c, r)
    t = _table("member", "address", "status", "incarnation", "ranks", "version")
    for m in sorted(r.members, key=lambda m: m.node_id):
        st = gpb.MemberStatus.Name(m.status).lower()
        colour = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}.get(st, "white")
        ranks = f"{min(m.ranks)}-{max(m.ranks)}" if m.ranks else "-"
        ver = r.peer_versions.get(m.node_id)
        t.add_row(m.node_id, m.address, f"[{colour}]{st}[/]", str(m.incarnation), ranks, "-" if ver is None else str(ver))
    c.print(t)
    rank_installs(c, r)


def cluster_lines(c: Console, r: apb.StatusReply) -> None:
    """The cluster-wide pause switch (who wrote it, when), the planner of the next version, fingerprint mismatches."""
    if r.HasField("pause"):
        p = r.pause.record
        when = dt.datetime.fromtimestamp(p.at_ms / 1000, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        asked = f" for admin {escape(p.admin)}" if p.admin else ""  # node_id admitted that admin's call
        c.print(f"pause: {'[yellow]paused[/]' if p.paused else 'resumed'} cluster-wide by {escape(p.node_id)}{asked} "
                f"at {when} (record {p.seq}: {escape(p.note) or '-'})")
    c.print((f"planner: {r.planner} plans version {r.committed_version + 1}" if r.planner
             else "planner: every agent plans each window") + (" (paused: no rebalance)" if r.paused else ""))
    for m in r.fingerprint_mismatches:
        c.print(f"[red]fingerprint mismatch[/]: {m.node_id}: {m.fields}")


def _age(s: float) -> str:
    return "-" if s < 0 else f"{s:.1f} s"


def rank_state(r: apb.StatusReply, i: apb.RankInstall) -> str:
    """One rank's install state in words (plain text: tests and scripts may match it)."""
    if i.error:  # its plugin's last fatal error (GENESIS_MISMATCH: ...)
        return i.error
    if not i.installed_version:
        if i.attached or i.report_age_s >= 0:
            return "attached, no version yet"
        return "no engine attached"
    if not i.attached and i.report_age_s > r.install_lag_bound_s:
        return f"no engine attached (last report {i.report_age_s:.0f} s ago)"
    if i.lagging:
        return f"LAGGING {i.lag_s:.1f} s"
    if i.installed_version < r.committed_version:
        return f"installing {i.lag_s:.1f} s"
    if i.installed_version > r.committed_version:
        return "ahead (agent catching up)"
    return "ok" if i.active else "ok (drained)"


def rank_installs(c: Console, r: apb.StatusReply) -> None:
    """Committed against installed for each of the answering node's engine ranks."""
    if not r.ranks:
        return
    c.print(f"engine ranks of [bold]{r.node_id}[/] (an agent shows its own node's ranks: ask each agent for its "
            f"own); installed: the version each engine runs, for how long, and its last report's age; behind "
            f"the committed version for over {r.install_lag_bound_s:.1f} s: LAGGING")
    t = _table("rank", "active", "committed", "installed", "for", "report", "state")
    for i in r.ranks:
        state = rank_state(r, i)
        colour = "red" if i.lagging else "yellow" if state.startswith("installing") else "white"
        t.add_row(str(i.rank), "yes" if i.active else "no", str(r.committed_version),
                  str(i.installed_version) if i.installed_version else "-", _age(i.installed_age_s),
                  _age(i.report_age_s), f"[{colour}]{state}[/]")
    c.print(t)


def _grid(r: apb.PlacementReply) -> tuple[np.ndarray, np.ndarray | None]:
    tb = r.table
    phy = np.frombuffer(tb.phy2log, dtype="<i8").reshape(tb.layers, tb.slots)
    load = None
    if r.expert_load:
        load = np.frombuffer(r.expert_load, dtype="<u4").reshape(tb.layers, tb.experts)
    return phy, load


def placement_json(r: apb.PlacementReply, layer: int) -> dict[str, Any]:
    tb = r.table
    phy, load = _grid(r)
    S = tb.slots_per_rank
    layers = range(tb.layers) if layer < 0 else [layer]
    out: dict[str, Any] = {"version": tb.version, "parent": tb.parent, "slots_per_rank": S,
                           "ranks_per_node": r.ranks_per_node, "active_ranks": list(tb.active_ranks),
                           "rank_nodes": rank_nodes(r), "layers": {}}
    for lay in layers:
        row = phy[lay]
        counts = np.bincount(row[row >= 0], minlength=tb.experts)
        out["layers"][str(lay)] = {
            "ranks": row.reshape(-1, S).tolist(),
            "replicas": {str(e): int(n) for e, n in enumerate(counts.tolist()) if n > 1},
            "hot": _hot(load[lay]).tolist() if load is not None else [],
        }
    return out


def _hot(load_row: np.ndarray, frac: float = 0.1) -> np.ndarray:
    k = max(1, int(len(load_row) * frac))
    if load_row.sum() == 0:
        return np.array([], dtype=np.int64)
    return np.sort(np.argsort(-load_row.astype(np.int64), kind="stable")[:k])


def rank_nodes(r: apb.PlacementReply) -> list[str]:
    """The node id of each rank, as `emoe status` names the nodes ("?" where no member claims the rank)."""
    ranks = r.table.slots // max(1, r.table.slots_per_rank)
    names = list(r.rank_nodes)
    return [names[g] if g < len(names) and names[g] else "?" for g in range(ranks)]


def placement(r: apb.PlacementReply, layer: int) -> None:
    c = _console()
    tb = r.table
    phy, load = _grid(r)
    S = tb.slots_per_rank
    nodes = rank_nodes(r)
    active = set(tb.active_ranks)
    c.print(f"routing table version [bold]{tb.version}[/] (parent {tb.parent}), {tb.layers} layers x {tb.experts} "
            f"experts, {tb.slots // S} ranks x {S} slots;  [bold red]E*[/] hot expert, [cyan]xN[/] replicas")
    for lay in range(tb.layers) if layer < 0 else [layer]:
        row = phy[lay]
        counts = np.bincount(row[row >= 0], minlength=tb.experts)
        hot = set(_hot(load[lay]).tolist()) if load is not None else set()
        t = Table("node", "rank", *[f"s{i}" for i in range(S)], title=f"layer {lay}", title_justify="left")
        for g in range(tb.slots // S):
            cells = []
            for e in row[g * S:(g + 1) * S].tolist():
                if e < 0:
                    cells.append("[dim]·[/]")
                    continue
                txt = f"{e}*" if e in hot else str(e)
                if e in hot:
                    txt = f"[bold red]{txt}[/]"
                if counts[e] > 1:
                    txt += f"[cyan]x{counts[e]}[/]"
                cells.append(txt)
            rank = str(g) if g in active else f"[dim]{g} (inactive)[/]"
            first = g == 0 or nodes[g - 1] != nodes[g]
            last = g == len(nodes) - 1 or nodes[g + 1] != nodes[g]
            t.add_row(nodes[g] if first else "", rank, *cells, end_section=last)
        c.print(t)


def history(r: apb.HistoryReply, verbose: bool = False) -> None:
    """One block per commit, newest first: no column headers to shorten on a narrow terminal; its operations
    under its version, summarised past SHORT_OPS unless `verbose`. Times are UTC."""
    c = _console()
    if all(e.parent == 0 and not e.plan.ops for e in r.entries):
        c.print("no commits since the initial table: nothing has been rebalanced yet")
        return
    for e in r.entries:
        if e.parent == 0 and not e.plan.ops:
            c.print(f"[bold]v{e.version}[/]  the initial table (genesis)")
            continue
        yes = sum(1 for v in e.votes if v.accept)
        c.print(f"[bold]v{e.version}[/]  parent {e.parent}  {when(e.committed_at_unix_ms)}  proposer "
                f"{e.proposer or '-'}  votes {yes}/{len(e.votes)}  est. gain {e.plan.estimated_gain:+.3f}"
                f"  verified {e.plan.verified_gain:+.3f}  cost {e.plan.cost:.3f} s")
        for line in op_lines(e.plan.ops, e.copy_bytes, verbose):
            c.print("    " + line)


def explain(r: apb.ExplainReply, verbose: bool = False) -> None:
    """The decision: outcome, trigger, gains, the chosen operations and the refused candidates (summarised past
    SHORT_OPS and SHORT_REFUSED unless `verbose`), the votes."""
    c = _console()
    c.print(f"version [bold]{r.version or '-'}[/]: outcome [bold]{r.outcome}[/]")
    trigger = r.trigger or "-"
    if not verbose and len(trigger) > TRIGGER_CHARS:
        trigger = trigger[:TRIGGER_CHARS] + f"... (--verbose: all {len(trigger)} characters)"
    c.print(f"trigger: {trigger}")
    if r.step_time:
        c.print(f"step time: {r.step_time}")
    if r.copy_cost:
        c.print(f"copy cost: {r.copy_cost}")
    p = r.plan
    c.print(f"estimated gain {p.estimated_gain:+.4f}, verified gain {p.verified_gain:+.4f}, cost {p.cost:.4f} s")
    lines = op_lines(p.ops, r.copy_bytes, verbose)
    if p.ops and (verbose or len(lines) > 1):
        c.print("chosen: " + (f"{len(p.ops)} operations" if verbose else lines[0]))
        for line in lines[0 if verbose else 1:]:
            c.print(f"  {line}")
    else:
        c.print(f"chosen: {lines[0]}")
    if r.refused:
        shown = list(r.refused)
        if not verbose and len(shown) > SHORT_REFUSED:
            why = Counter(cand.reason for cand in shown)
            c.print(f"not taken: {len(shown)} candidates: " + ", ".join(
                f"{n} {k}" for k, n in sorted(why.items(), key=lambda kv: (-kv[1], kv[0])))
                + f"; the {SHORT_REFUSED} with the highest gain below (--verbose lists all)")
            shown = sorted(shown, key=lambda cand: -cand.gain)[:SHORT_REFUSED]
        t = _table("refused candidate", "gain", "cost (s)", "reason", title="not taken", title_justify="left")
        for cand in shown:
            t.add_row(describe_pb(cand.op) if cand.HasField("op") else "-", f"{cand.gain:+.4f}", f"{cand.cost:.4f}",
                      cand.reason)
        c.print(t)
    if r.votes:
        t = _table("voter", "vote", "verified gain", "reason", title="votes", title_justify="left")
        for v in r.votes:
            t.add_row(v.voter, "[green]yes[/]" if v.accept else "[red]no[/]", f"{v.verified_gain:+.4f}", v.reason)
        c.print(t)


def _spark(xs: list[float]) -> str:
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((x - lo) / span * 7.999))] for x in xs)


def _members(s: apb.StatusReply) -> list[dict[str, str]]:
    return [{"node": m.node_id, "status": gpb.MemberStatus.Name(m.status).lower()}
            for m in sorted(s.members, key=lambda m: m.node_id)]


NO_LOAD = ("no load has arrived yet: no engine's shim has reported a load window to the agents "
           "(start the engines with the shim attached)")


def top_json(s: apb.StatusReply, v: apb.LoadViewReply, h: apb.HistoryReply) -> dict[str, Any]:
    rank_load = np.frombuffer(v.rank_load, dtype="<u8").tolist() if v.rank_load else []
    return {"node": s.node_id, "version": s.committed_version, "step_imbalance": v.step_imbalance,  # 0.0: no window yet
            "members": _members(s), "load_arrived": bool(v.rank_load),
            "rank_load": rank_load, "imbalance_history": list(v.imbalance_history),
            "recent": [{"version": e.version, "ops": [describe_pb(o) for o in e.plan.ops]} for e in h.entries]}


def top(s: apb.StatusReply, v: apb.LoadViewReply, h: apb.HistoryReply, clear: bool = True) -> None:
    c = _console()
    if clear:
        c.clear()
    c.print(f"[bold]emoe top[/]  agent {s.node_id}  version {s.committed_version}  "
            f"step imbalance {imbalance(v.step_imbalance)}  {_spark(list(v.imbalance_history)[-40:])}")
    c.print("members: " + (", ".join(f"{m['node']} ({m['status']})" for m in _members(s)) or "none known yet"))
    loads = np.frombuffer(v.rank_load, dtype="<u8") if v.rank_load else np.zeros(0, dtype=np.uint64)
    if not loads.size:
        c.print(NO_LOAD)
    peak = float(loads.max()) if loads.size else 0.0
    for g, x in enumerate(loads.tolist()):
        bar = "█" * int(40 * x / peak) if peak else ""
        c.print(f"rank {g:3d} {bar:<40} {x}")
    for e in h.entries[:5]:
        c.print(f"v{e.version} {when(e.committed_at_unix_ms)}: "
                + (op_lines(e.plan.ops, e.copy_bytes, False)[0] if e.plan.ops else "(initial)"))
