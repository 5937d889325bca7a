"""Rank loss in `emoe bench` (`--kill-rank R@STEP`): the events, the tables that react, and the accounting.

Model (the same for every policy; what differs is how each reacts):
- at STEP rank R dies: its slots vanish and it leaves the step-time and imbalance model (a layer waits for
  its slowest *live* rank; the mean is over live ranks). Its senders' share of the batch is kept as demand.
- a token-expert pair routed to a slot on a dead rank is not served. Policies that run this project's shim
  (`elastic`) never send it: before detection the shim's dispatch waits on the dead peer's version counter
  (bounded) and holds the pair; once the rank is known lost (`detect` steps after the kill: its own agent
  sees its local link close, or membership declares its whole node dead) the shim masks the rank at once, so pairs of experts that still have a replica go there, and pairs of experts
  whose only replicas were on R stay held until the repair table lands. Held pairs are `delayed` (with their
  delay in steps), or `dropped` if the trace ends first. A held pair adds no load when it is finally served
  (a small under-count of the repair's load, the same direction for every holding policy).
- EPLB as vLLM and SGLang ship it does not react to rank loss: pairs keep going to the dead rank's slots
  (`sent_to_dead_rank`, all `dropped`) until its next periodic full rebalance, which (generously: in
  practice a restart) plans over the surviving ranks and reloads lost experts from the host tier.
- static and CRAFT never react; hindsight (the oracle) installs EPLB over the survivors, free, at the kill.
Recovery after a kill: steps until the W-step moving average of step imbalance is within 10% of hindsight's
mean over [kill, next drift point or end) and stays so for W steps, counting only steps where every pair
was served (a step with held or dropped pairs is not recovered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from controlplane.baselines.eplb import eplb_phy2log, eplb_table, preserve_slots
from controlplane.baselines.hindsight import segment_bounds
from controlplane.errors import InvalidTable
from controlplane.table import RoutingTable

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Mask = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Kill:
    rank: int
    step: int


def parse_kills(specs: list[str], ranks: int, steps: int) -> list[Kill]:
    """`R@STEP` specs -> kills sorted by step; ValueError naming the bad spec."""
    out = []
    for spec in specs:
        r, sep, s = spec.partition("@")
        if not sep or not r.strip().isdigit() or not s.strip().isdigit():
            raise ValueError(f"--kill-rank {spec!r}: expected R@STEP, e.g. 3@1000")
        k = Kill(int(r), int(s))
        if not 0 <= k.rank < ranks:
            raise ValueError(f"--kill-rank {spec!r}: rank {k.rank} not in 0..{ranks - 1}")
        if not 0 < k.step < steps:
            raise ValueError(f"--kill-rank {spec!r}: step {k.step} not in 1..{steps - 1}")
        out.append(k)
    if len({k.rank for k in out}) != len(out):
        raise ValueError("--kill-rank: a rank can die only once")
    if len(out) >= ranks:
        raise ValueError(f"--kill-rank: {len(out)} kills leave no live rank of {ranks}")
    return sorted(out, key=lambda k: (k.step, k.rank))


def masked(table: RoutingTable, dead: Mask) -> RoutingTable:
    """`table` as a shim that masks the dead ranks serves it: their slots empty, themselves inactive. May be
    invalid (an expert whose only replicas were dead has none): that is the point."""
    if not dead.any() or not any(dead[list(table.active_ranks)]):
        return table
    S = table.topology.slots_per_rank
    phy = table.phy2log.copy()
    phy[:, np.repeat(dead, S)] = -1
    live = tuple(g for g in table.active_ranks if not dead[g])
    return RoutingTable(table.topology, table.experts, phy, table.version, table.parent, live)


def eplb_surviving(prev: RoutingTable, totals: npt.NDArray[np.integer], dead: set[int], groups: int = 1) -> RoutingTable:
    """EPLB's full rebalance over the live ranks only (global policy when ranks are missing): the successor
    of `prev` with the dead ranks inactive and empty. totals [L, E]."""
    topo = prev.topology
    if not dead:
        return eplb_table(prev, totals, groups)
    live = [g for g in range(topo.ranks) if g not in dead]
    S, L = topo.slots_per_rank, prev.layers
    if not live or prev.experts > len(live) * S:
        raise InvalidTable(f"{prev.experts} experts do not fit on {len(live)} live ranks of {S} slots")
    phy_live = eplb_phy2log(np.asarray(totals), len(live) * S, 1, 1, len(live))
    phy = np.full((L, topo.ranks, S), -1, dtype=np.int64)
    phy[:, live, :] = phy_live.reshape(L, len(live), S)
    out = preserve_slots(phy.reshape(L, -1), prev.phy2log, topo.ranks)
    table = prev.successor(out, tuple(live))
    table.validate()
    return table


def hindsight_with_kills(base: RoutingTable, counts: npt.NDArray[np.integer], drift_steps: list[int],
                         kills: list[Kill], groups: int = 1) -> list[tuple[int, RoutingTable]]:
    """The oracle: per segment (cut at drift points and kills) EPLB on its exact totals over the ranks live
    in it. counts [T, L, E] -> [(first step, table)]."""
    c = np.asarray(counts)
    out: list[tuple[int, RoutingTable]] = []
    prev = base
    for a, b in segment_bounds(int(c.shape[0]), sorted({*drift_steps, *(k.step for k in kills)})):
        dead = {k.rank for k in kills if k.step <= a}
        prev = eplb_surviving(prev, c[a:b].sum(axis=0, dtype=np.int64), dead, groups)
        out.append((a, prev))
    return out


@dataclass
class Outage:
    """Per-run accounting of pairs that a dead rank left unserved. Chunks are runs of steps under one
    serving state: (first step, unserved pairs [n, L, E], servable [L, E]: experts a masking shim serves)."""

    holds: bool
    chunks: list[tuple[int, npt.NDArray[np.int64] | None, Mask | None]] = field(default_factory=list)
    lost_at: npt.NDArray[np.int64] | None = None  # [T] unserved pairs per step (filled by finish)
    detect_steps: list[int] = field(default_factory=list)
    repair_steps: list[int] = field(default_factory=list)

    def record(self, first: int, lost: npt.NDArray[np.int64] | None, servable: Mask | None) -> None:
        self.chunks.append((first, lost, servable))

    def finish(self, T: int) -> dict[str, float | int]:
        """Count delayed (held, then served: delay = first later chunk whose servable covers the expert)
        and dropped pairs. Returns the figures; fills lost_at."""
        lost_at = np.zeros(T, dtype=np.int64)
        delayed = dropped = sent = 0
        delay_sum, delay_max = 0, 0
        for i, (first, lost, _) in enumerate(self.chunks):
            if lost is None or not lost.any():
                continue
            n = lost.shape[0]
            lost_at[first:first + n] = lost.sum(axis=(1, 2))
            if not self.holds:
                sent += int(lost.sum())
                continue
            deliver = np.full(lost.shape[1:], -1, dtype=np.int64)
            for f2, _, serv in self.chunks[i + 1:]:
                if serv is not None:
                    deliver = np.where((deliver < 0) & serv, f2, deliver)
            ok = deliver >= 0
            dropped += int(lost[:, ~ok].sum())
            got = lost[:, ok]  # [n, K]
            delayed += int(got.sum())
            delay = deliver[ok][None, :] - (first + np.arange(n))[:, None]
            delay_sum += int((got * delay).sum())
            if got.any():
                delay_max = max(delay_max, int(delay[got > 0].max()))
        self.lost_at = lost_at
        return {"delayed_tokens": delayed, "dropped_tokens": dropped + sent, "sent_to_dead_rank": sent,
                "mean_delay_steps": delay_sum / delayed if delayed else 0.0, "max_delay_steps": delay_max}


def recovery_after(imb: F64, lost_at: npt.NDArray[np.int64], ref: F64, kill: int, end: int, window: int) -> int:
    """Steps from `kill` until the trailing W-step mean of `imb` (from the kill on) is <= 1.1 x ref's mean
    over [kill, end) and every pair is served, and both stay so for W steps; end - kill if never."""
    from bench.traces import moving_average

    seg = imb[kill:end]
    ok = (moving_average(seg, window) <= 1.1 * float(ref[kill:end].mean())) & (lost_at[kill:end] == 0)
    n = seg.size
    bad = np.concatenate([np.flatnonzero(~ok), [n]])
    nxt_bad = bad[np.searchsorted(bad, np.arange(n))]
    good = np.flatnonzero(ok & ((nxt_bad - np.arange(n) >= window) | (nxt_bad == n)))
    return int(good[0]) if good.size else int(n)
