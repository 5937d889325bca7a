"""Human renderings (rich) and JSON shapes of admin replies."""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from agent.wire import describe_pb
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import gossip_pb2 as gpb

SPARK = "▁▂▃▄▅▆▇█"


def _console() -> Console:
    return Console(highlight=False, soft_wrap=True)


def _when(ms: int) -> str:
    if not ms:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC).strftime("%H:%M:%S")


def status(r: apb.StatusReply) -> None:
    c = _console()
    c.print(f"agent [bold]{r.node_id}[/]  committed version [bold]{r.committed_version}[/]  health {r.health}"
            f"  {'[yellow]paused[/]' if r.paused else 'rebalancing on'}  step imbalance {r.step_imbalance:.3f}"
            f"  window {r.window_seq}")
    if r.role and r.role != "voter":
        c.print(f"role: [yellow]{r.role}[/]")
    t = Table("member", "address", "status", "incarnation", "ranks", "version")
    for m in sorted(r.members, key=lambda m: m.node_id):
        st = gpb.MemberStatus.Name(m.status).lower()
        colour = {"alive": "green", "suspect": "yellow", "dead": "red", "left": "dim"}.get(st, "white")
        ranks = f"{min(m.ranks)}-{max(m.ranks)}" if m.ranks else "-"
        ver = r.peer_versions.get(m.node_id)
        t.add_row(m.node_id, m.address, f"[{colour}]{st}[/]", str(m.incarnation), ranks, "-" if ver is None else str(ver))
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
                           "ranks_per_node": r.ranks_per_node, "active_ranks": list(tb.active_ranks), "layers": {}}
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


def placement(r: apb.PlacementReply, layer: int) -> None:
    c = _console()
    tb = r.table
    phy, load = _grid(r)
    S, rpn = tb.slots_per_rank, max(1, r.ranks_per_node)
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
            t.add_row(f"n{g // rpn}" if g % rpn == 0 else "", rank, *cells, end_section=(g % rpn == rpn - 1))
        c.print(t)


def history(r: apb.HistoryReply) -> None:
    c = _console()
    t = Table("version", "parent", "time", "proposer", "operations", "est. gain", "verified", "cost (s)", "votes")
    for e in r.entries:
        ops = "; ".join(describe_pb(o) for o in e.plan.ops) or "(initial)"
        yes = sum(1 for v in e.votes if v.accept)
        t.add_row(str(e.version), str(e.parent), _when(e.committed_at_ms), e.proposer or "-", ops,
                  f"{e.plan.estimated_gain:+.3f}", f"{e.plan.verified_gain:+.3f}", f"{e.plan.cost:.3f}",
                  f"{yes}/{len(e.votes)}")
    c.print(t)


def explain(r: apb.ExplainReply) -> None:
    c = _console()
    c.print(f"version [bold]{r.version or '-'}[/]: outcome [bold]{r.outcome}[/]")
    c.print(f"trigger: {r.trigger or '-'}")
    p = r.plan
    c.print(f"estimated gain {p.estimated_gain:+.4f}, verified gain {p.verified_gain:+.4f}, cost {p.cost:.4f} s")
    for o in p.ops:
        c.print(f"  chosen: {describe_pb(o)}")
    if r.refused:
        t = Table("refused candidate", "reason", "gain", "cost (s)", title="not taken", title_justify="left")
        for cand in r.refused:
            t.add_row(describe_pb(cand.op) if cand.HasField("op") else "-", cand.reason, f"{cand.gain:+.4f}",
                      f"{cand.cost:.4f}")
        c.print(t)
    if r.votes:
        t = Table("voter", "vote", "verified gain", "reason", title="votes", title_justify="left")
        for v in r.votes:
            t.add_row(v.voter, "[green]yes[/]" if v.accept else "[red]no[/]", f"{v.verified_gain:+.4f}", v.reason)
        c.print(t)


def _spark(xs: list[float]) -> str:
    if not xs:
        return ""
    lo, hi = min(xs), max(xs)
    span = (hi - lo) or 1.0
    return "".join(SPARK[min(7, int((x - lo) / span * 7.999))] for x in xs)


def top_json(s: apb.StatusReply, v: apb.LoadViewReply, h: apb.HistoryReply) -> dict[str, Any]:
    rank_load = np.frombuffer(v.rank_load, dtype="<u8").tolist() if v.rank_load else []
    return {"node": s.node_id, "version": s.committed_version, "step_imbalance": v.step_imbalance,
            "rank_load": rank_load, "imbalance_history": list(v.imbalance_history),
            "recent": [{"version": e.version, "ops": [describe_pb(o) for o in e.plan.ops]} for e in h.entries]}


def top(s: apb.StatusReply, v: apb.LoadViewReply, h: apb.HistoryReply, clear: bool = True) -> None:
    c = _console()
    if clear:
        c.clear()
    c.print(f"[bold]emoe top[/]  agent {s.node_id}  version {s.committed_version}  "
            f"step imbalance {v.step_imbalance:.3f}  {_spark(list(v.imbalance_history)[-40:])}")
    loads = np.frombuffer(v.rank_load, dtype="<u8") if v.rank_load else np.zeros(0, dtype=np.uint64)
    peak = float(loads.max()) if loads.size else 0.0
    for g, x in enumerate(loads.tolist()):
        bar = "█" * int(40 * x / peak) if peak else ""
        c.print(f"rank {g:3d} {bar:<40} {x}")
    for e in h.entries[:5]:
        c.print(f"v{e.version}: " + ("; ".join(describe_pb(o) for o in e.plan.ops) or "(initial)"))
