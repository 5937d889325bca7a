"""`emoe bench`: every policy on the same trace, cluster, router and step-time model; results.json + plots.

`simulate` replays a trace under one policy, window by window, its changes installed by their mode (copies
overlapped with serving, or blocking); `run_bench` runs every policy so and writes what bench.metrics makes of
each run.
"""
from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from bench.engine import H200, EPCluster, StepResult, lost_by_expert, shape_for
from bench.measured import copy_entry, measured_steps, step_time_entry
from bench.metrics import Install, PolicyRun, rank_loss_entry, summarize
from bench.policies import Change, Elastic, Hindsight, Policy, controller_available, make_policy
from bench.rankloss import Kill, Outage, masked
from bench.traces import Trace
from controlplane.baselines.eplb import eplb_table
from controlplane.baselines.static import static_table
from controlplane.params import DecisionParams
from controlplane.table import RoutingTable
from controlplane.topology import Topology

F64 = npt.NDArray[np.float64]


def _replicas(t: RoutingTable) -> int:
    return int((t.phy2log >= 0).sum()) - t.layers * t.experts


def simulate(policy: Policy, cluster: EPCluster, base: RoutingTable, trace: Trace, window: int,
             copy_share: float, tick: Callable[[], None] | None = None, kills: list[Kill] | None = None,
             detect: Callable[[F64, int], int] | None = None) -> PolicyRun:
    """Replay `trace` window by window under `policy`; changes apply by their mode (see bench.policies).

    kills: rank deaths (bench.rankloss). detect(step_ms so far, kill step) -> the step at which membership
    declares the rank dead; a policy with `holds_tokens` (the shim) then masks it and is told
    (`on_ranks_lost`); a policy without is told at the kill (it only acts at its next full rebalance)."""
    counts = trace.counts
    T = counts.shape[0]
    run = PolicyRun(np.zeros(T), np.zeros(T), np.zeros(T), np.zeros(T), replica_slots=_replicas(base))
    table = base
    queue: list[Change] = sorted(policy.start(base, counts, trace.drift_steps), key=lambda c: c.ready_step)
    copying: tuple[Change, float, float] | None = None  # change, ms needed, ms done
    holds = bool(getattr(policy, "holds_tokens", False))
    run.outage = Outage(holds)
    dead = np.zeros(cluster.topo.ranks, dtype=bool)
    masked_ranks = np.zeros_like(dead)  # dead ranks the policy's shim has masked (after detection)
    events: list[tuple[int, int, int]] = [(k.step, 0, k.rank) for k in kills or []]  # (step, 0 kill | 1 detect, rank)
    ran = np.zeros(T, dtype=np.int64)  # the table version each step was served on (what the engines report)

    def install(ch: Change, step: int, charge: bool) -> None:
        nonlocal table
        mv = cluster.moves(table, ch.table, dead)
        if charge:
            run.bytes_at[min(step, T - 1)] += mv.bytes_total
        if ch.mode == "blocking":
            run.stall_ms[min(step, T - 1)] += cluster.copy_ms(mv)
        run.installs.append(Install(step, table, ch.table, mv.bytes_total, ch.kind))
        table = ch.table
        run.replica_slots = max(run.replica_slots, _replicas(table))
        if dead.any() and not any(dead[list(table.active_ranks)]) and len(run.outage.repair_steps) < int(dead.sum()):
            run.outage.repair_steps.append(step)

    def on_events(t: int) -> None:
        while events and events[0][0] <= t:
            _, what, rank = events.pop(0)
            if what == 0:
                dead[rank] = True
                if holds and detect is not None:
                    at = max(t, detect(run.step_ms[:t], t))
                    events.append((at, 1, rank))
                    events.sort()
                    run.outage.detect_steps.append(at)
                elif hasattr(policy, "on_ranks_lost"):
                    queue.extend(policy.on_ranks_lost(t, [rank]))
            else:
                masked_ranks[rank] = True
                if hasattr(policy, "on_ranks_lost"):
                    queue.extend(policy.on_ranks_lost(t, [rank]))
            queue.sort(key=lambda c: c.ready_step)

    def serve(t: int, stop: int, scale: F64 | None) -> StepResult:
        if not dead.any():
            run.outage.record(t, None, None)
            return cluster.run(table, counts[t:stop], scale)
        shown = masked(table, masked_ranks)  # what the shim serves: masked dead ranks are gone
        res = cluster.run(shown, counts[t:stop], scale, dead)
        lost = np.zeros((stop - t, table.layers, table.experts), dtype=np.int64) if res.lost is None else res.lost
        lone = shown.logcnt == 0  # experts without a live replica: a masking shim holds their pairs
        lost += np.asarray(counts[t:stop], dtype=np.int64) * lone[None]
        live = shown.logcnt > 0  # a held pair is served once its expert has a replica, none of them on an
        if any(dead[list(shown.active_ranks)]):  # unmasked dead rank (the shim still waits on those)
            live &= lost_by_expert(shown, np.ones((1, *shown.phy2log.shape), np.int64), dead)[0] == 0
        run.outage.record(t, lost, live if holds else None)
        return res

    cadence = int(getattr(policy, "cadence", window))  # steps between the policy's decisions (elastic: the agents' window)
    for first in range(0, T, cadence):
        end = min(T, first + cadence)
        t = first
        while t < end:
            on_events(t)
            if copying is None:
                while queue and queue[0].ready_step <= t:
                    ch = queue.pop(0)
                    if ch.mode == "overlapped":
                        mv = cluster.moves(table, ch.table, dead)
                        run.bytes_at[t] += mv.bytes_total
                        copying = (ch, cluster.copy_ms(mv, copy_share), 0.0)
                        run.copies.append((t, 0, 0.0))
                        break
                    install(ch, t, charge=True)
            stop = min([end] + [c.ready_step for c in queue if c.ready_step > t] + [e[0] for e in events if e[0] > t])
            if copying is None:
                res = serve(t, stop, None)
                run.imbalance[t:stop], run.step_ms[t:stop] = res.imbalance, res.step_ms
                ran[t:stop] = table.version
                t = stop
                continue
            ch, need, done = copying
            scale = cluster.link_scale_during(cluster.moves(table, ch.table, dead), copy_share)
            res = serve(t, stop, scale)
            cum = done + np.cumsum(res.step_ms)
            hit = np.flatnonzero(cum >= need)
            n = int(hit[0]) + 1 if hit.size else stop - t
            calm = (cluster.run(table, counts[t:t + n]) if not dead.any() else  # the same steps, no copy in flight
                    cluster.run(masked(table, masked_ranks), counts[t:t + n], None, dead)).step_ms
            began, steps, extra = run.copies[-1]
            run.copies[-1] = (began, steps + n, extra + float((res.step_ms[:n] - calm).sum()))
            run.imbalance[t:t + n], run.step_ms[t:t + n] = res.imbalance[:n], res.step_ms[:n]
            ran[t:t + n] = table.version  # (the old table serves while the new one's copies are in flight)
            if n < stop - t:  # the chunk's accounting covers only the steps served before the install
                first_step, lost, live = run.outage.chunks[-1]
                run.outage.chunks[-1] = (first_step, None if lost is None else lost[:n], live)
            if hit.size:
                copying = None
                if t + n < T:
                    install(ch, t + n, charge=False)
                    ch.ready_step = t + n
            else:
                copying = (ch, need, float(cum[-1]))
            t += n
        if hasattr(policy, "served_ms"):  # what the engine served each step, copies in flight included
            policy.served_ms = run.step_ms
        if hasattr(policy, "served_version"):  # and on which table
            policy.served_version = ran
        queue.extend(policy.on_window(first, end, counts[:end]))
        queue.sort(key=lambda c: c.ready_step)
        if tick is not None and (end // window > first // window or end == T):  # progress counts W-step windows
            tick()
    run.step_ms += run.stall_ms
    return run


def _agree_every() -> int:
    from dataplane_shim.plugin import AGREE_EVERY

    return AGREE_EVERY


@dataclass
class BenchConfig:
    nodes: int
    ranks_per_node: int
    slots_per_rank: int
    window: int = 100
    policies: tuple[str, ...] = ("static", "eplb", "craft", "craft-periodic", "elastic", "hindsight")
    seed: int = 0
    expert_groups: int | None = None  # EPLB groups; None: 1 (global EPLB, the decode-pool choice)
    craft_budget: float = 1.0
    commit_latency: int = 3
    copy_share: float = 0.5
    elastic_params: dict[str, Any] = field(default_factory=dict)
    kills: tuple[Kill, ...] = ()
    # the time until the killed rank is known lost: a rank's process dies while its node's agent lives, and
    # that agent sees the rank's local link close (agent.link.ranklink): detect_p99_ms of `python -m bench.rankexit
    # --json`, 0.26 s (0.25 s of it the reconnect grace). A whole node's death is found by membership instead:
    # detect_p99_s of `python -m bench.detect --nodes 64 --json` (SWIM + Lifeguard, lan, 5% loss), 2.477 s.
    # Converted to steps with the step-time model (the trailing-W mean step time at the kill) unless
    # detect_steps is given.
    detect_s: float = 0.26
    detect_steps: int | None = None
    initial: str = "static"  # every policy's boot placement: "static" or "eplb:SPEC" (fitted on initial_totals)
    initial_totals: npt.NDArray[np.int64] | None = None  # [L, E] for "eplb:SPEC"
    elastic_profile: Any = None  # a StabilityProfile for the elastic policy's planner (None: none)
    agree_every: int | None = None  # the plugins' version agreement period (None: their default)
    live: bool = False  # the elastic policy as real agent processes fed by the plugins' core (bench.live)
    live_step_s: float = 0.01  # wall seconds a replayed step takes in a live run
    # how the trace's steps were built (steady state or a cold start; bench.cli_bench.construction), for results.json
    construction: dict[str, Any] | None = None


def run_bench(trace: Trace, cfg: BenchConfig, out: Path | None = None, progress: bool = True,
              plots: bool = True) -> dict[str, Any]:
    """Run every policy of `cfg` on `trace`; write results.json (and plots) under `out` when given."""
    T, L, E = trace.shape
    topo = Topology(cfg.nodes, cfg.ranks_per_node, cfg.slots_per_rank)
    groups = cfg.expert_groups if cfg.expert_groups is not None else 1  # global EPLB: a decode pool
    base = static_table(topo, L, E)
    if cfg.initial_totals is not None:
        base = eplb_table(base, cfg.initial_totals, groups)
    shape = shape_for(L, E, trace.top_k)
    cluster = EPCluster(topo, shape, H200)
    names = list(dict.fromkeys(cfg.policies))
    if "hindsight" in names:  # the reference runs first: recovery needs it
        names.remove("hindsight")
        names.insert(0, "hindsight")
    unavailable: dict[str, str] = {}
    why = controller_available()
    if "elastic" in names and why is not None:
        unavailable["elastic"] = why
        names.remove("elastic")
    runs: dict[str, PolicyRun] = {}
    policy_objs: dict[str, Policy] = {}
    kills = list(cfg.kills)
    if kills and E > (topo.ranks - len(kills)) * topo.slots_per_rank:
        raise ValueError(f"--kill-rank: {E} experts do not fit on the {topo.ranks - len(kills)} surviving ranks of "
                         f"{topo.slots_per_rank} slots")

    def detect(step_ms: F64, t: int) -> int:
        if cfg.detect_steps is not None:
            return t + cfg.detect_steps
        recent = step_ms[max(0, t - cfg.window):t]
        per_step = float(recent.mean()) if recent.size else 1.0
        return t + int(np.ceil(cfg.detect_s * 1e3 / per_step))

    windows = -(-T // cfg.window)
    t0 = time.perf_counter()
    with _progress(progress, windows * (len(names) + (0 if "hindsight" in names else 1))) as tick:
        ref_policy = make_policy("hindsight", cfg.window, groups, cfg.craft_budget, cfg.commit_latency)
        if isinstance(ref_policy, Hindsight):
            ref_policy.kills = kills
        if "hindsight" not in names:
            ref_run = simulate(ref_policy, cluster, base, trace, cfg.window, cfg.copy_share, tick, kills, detect)
        # the agents fit their step time from the step times the engines' plugins report (controlplane.steptime;
        # `measured` below); --elastic-param load_ms=... is an operator's override, used as it is.
        # The agents close windows of their own decision.window (the shipped default unless --elastic-param
        # window=N), whatever the bench's W, which is the metrics' window and the baselines' cadence
        elastic_params = {"window": DecisionParams.window, "expert_bytes": int(shape.expert_bytes),
                          **cfg.elastic_params}
        if "load_ms" in cfg.elastic_params:
            elastic_params["load_ms_override"] = True
        measured = measured_steps(cluster, base, trace.counts[:cfg.window], cfg.seed)
        live: Any = None
        if cfg.live and "elastic" in names:
            from bench.live import LivePlayback, behind, behind_warning, run_live

            if kills:
                raise ValueError("--live with --kill-rank: a live run kills no rank (chaos/ does that)")
            t_live = time.perf_counter()
            lr = run_live(trace.counts, trace.top_k, base, cfg.window, elastic_params, cfg.live_step_s, progress,
                          cfg.agree_every, measured)
            installs = lr.installs
            T = int(trace.counts.shape[0])
            warn = behind_warning(T, cfg.live_step_s, lr.replay_s, topo.nodes, topo.ranks)
            if warn:
                print(warn, file=sys.stderr)
            live = {"installs": [{"step": i.step, "version": i.table.version} for i in installs],
                    "step_s": cfg.live_step_s, "wall_s": round(time.perf_counter() - t_live, 1),
                    "replay_s": round(lr.replay_s, 1), "behind": round(behind(T, cfg.live_step_s, lr.replay_s), 3),
                    "agents": topo.nodes, "plugin_cores": topo.ranks,
                    # what `emoe explain` says each installed version was decided with (step time, copy cost)
                    "explained": {str(v): said for v, said in sorted(lr.explained.items())}}
        for name in names:
            if name == "elastic" and live is not None:
                pol: Policy = LivePlayback(installs, cfg.window)
                policy_objs[name] = pol
                runs[name] = simulate(pol, cluster, base, trace, cfg.window, cfg.copy_share, tick, kills, detect)
                continue
            pol = make_policy(name, cfg.window, groups, cfg.craft_budget, cfg.commit_latency, elastic_params,
                              cfg.agree_every)
            if isinstance(pol, Hindsight):
                pol.kills = kills
            if isinstance(pol, Elastic):
                pol.profile = cfg.elastic_profile
                pol.step_ms = measured
            policy_objs[name] = pol
            runs[name] = simulate(pol, cluster, base, trace, cfg.window, cfg.copy_share, tick, kills, detect)
        if "hindsight" in names:
            ref_run = runs["hindsight"]
    elapsed = time.perf_counter() - t0
    results: dict[str, Any] = {
        "trace": {"source": trace.source, "model": trace.model, "shape": [T, L, E], "top_k": trace.top_k},
        "step_model": trace.step_model,
        "construction": cfg.construction if cfg.construction is not None else {"name": "unrecorded"},
        "drift_steps": list(trace.drift_steps),
        "policies": {},
        "cluster": {"nodes": cfg.nodes, "ranks_per_node": cfg.ranks_per_node, "slots_per_rank": cfg.slots_per_rank,
                    "window": cfg.window, "seed": cfg.seed, "expert_groups": groups,
                    "eplb": "global" if groups == 1 else f"hierarchical, {groups} groups", "initial": cfg.initial},
        "engine": {"model": shape.name, "expert_bytes": shape.expert_bytes, "hardware": "H200 (see bench.engine)",
                   "router": getattr(cluster.router, "label", type(cluster.router).__name__), "commit_latency_steps": cfg.commit_latency,
                   "agree_every": cfg.agree_every or _agree_every(),
                   "copy_share": cfg.copy_share, "craft_budget_fraction": cfg.craft_budget},
        "wall_s": elapsed,
    }
    if kills:
        results["rank_loss"] = {
            "kills": [{"rank": k.rank, "step": k.step} for k in kills], "detect_s": cfg.detect_s,
            "detect_steps": cfg.detect_steps, "model": "see bench.rankloss: elastic holds pairs it cannot serve "
            "(masks after detection, repair via RanksLost); eplb sends to the dead rank until its next periodic "
            "rebalance over the survivors; static/craft never react; hindsight re-plans free at the kill. detect_s is "
            "converted with the modelled decode step time (MoE part plus attention, dense layers, shared experts and "
            "LM head: bench.engine); --detect-steps sets them directly"}
    for name in cfg.policies:
        if name in unavailable:
            results["policies"][name] = {"unavailable": unavailable[name]}
            continue
        if name not in runs:
            continue
        pol = policy_objs[name]
        committed = len(pol.decisions) if isinstance(pol, Elastic) else None  # tables committed by quorum
        entry = summarize(runs[name], trace.counts, ref_run.imbalance, trace.drift_steps, cfg.window, committed, kills,
                          trace.top_k)
        if isinstance(pol, Elastic):
            entry["agent_window"] = pol.window
            entry["decisions"] = pol.decisions
            entry["outcomes"] = dict(Counter(e["outcome"] for e in pol.explains))
            entry["explain"] = pol.explains
            entry["gossip_window_bytes"] = pol.feed.bytes_per_window()  # a node's window as gossip sends it
            entry.update(step_time_entry(pol, cluster, trace.counts, int(pol.pipeline.params.sample_every)))
            entry.update(copy_entry(pol, runs[name], len(base.active_ranks)))
        if name == "elastic" and live is not None:
            entry["agent_window"] = int(elastic_params["window"])
            entry["live"] = live
        if kills:
            entry["rank_loss"] = rank_loss_entry(runs[name], ref_run, kills, trace.drift_steps, cfg.window)
            entry["recovery_steps_after_kill"] = entry["rank_loss"]["recovery_steps"]
            entry["delayed_tokens"] = entry["rank_loss"]["delayed_tokens"]
            entry["dropped_tokens"] = entry["rank_loss"]["dropped_tokens"]
        results["policies"][name] = entry
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
        if plots:
            from bench.plots import draw

            draw(out, {n: (r.imbalance, r.step_ms, r.bytes_at) for n, r in runs.items()}, trace.drift_steps, cfg.window)
    return results


class _progress:
    """A rich progress bar on stderr (a no-op when disabled); yields a tick callable."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.bar.__enter__()
        task = self.bar.add_task("emoe bench (windows x policies)", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.__exit__(None, None, None)
