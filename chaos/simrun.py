"""The in-process runner: one schedule against a SimCluster, checked by chaos/invariants.py."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from chaos.invariants import INVARIANTS, check_cluster
from chaos.schedules import apply, generate
from chaos.simcluster import Shape, SimCluster


@dataclass
class RunResult:
    seed: int
    nodes: int
    lines: list[str]
    done: list[str] = field(default_factory=list)
    violations: dict[str, list[str]] = field(default_factory=dict)
    convergence_s: list[float] = field(default_factory=list)
    commits: int = 0
    repairs: int = 0
    rollbacks: int = 0  # committed rollbacks (a change that realised worse than its parent, undone)
    i6_judged: int = 0
    wipes: int = 0  # data_dirs wiped (store and IDENTITY marker)
    wipes_at_genesis: int = 0  # of which while the node's head was genesis (before its first commit)
    detect_s: list[float] = field(default_factory=list)
    tokens: dict[str, Any] = field(default_factory=dict)
    shims: dict[str, int] = field(default_factory=dict)
    virtual_s: float = 0.0
    cpu_s: float = 0.0

    def counts(self) -> dict[str, int]:
        return {k: len(self.violations.get(k, [])) for k in INVARIANTS}

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["violation_counts"] = self.counts()
        return d


def run_schedule(nodes: int, seed: int, lines: list[str] | None = None, shape: Shape | None = None,
                 faults: int = 3, skew: bool = False, disks: bool = False, shifts: bool = True,
                 **cluster_kw: Any) -> RunResult:
    """Build a cluster from `seed`, play `lines` (default: generated from the seed), check I1-I7."""
    t0 = time.process_time()
    rng = random.Random(seed ^ 0xC4A05)
    lines = lines if lines is not None else generate(rng, nodes, faults, skew, disks, shifts)
    c = SimCluster(nodes, shape or Shape(), seed, **cluster_kw)
    res = RunResult(seed, nodes, list(lines))
    for line in lines:
        res.done.append(f"t={c.clock.now():.2f} {apply(c, line, rng)}")
    rep = check_cluster(c)
    res.violations = rep.violations
    res.convergence_s = rep.convergence_s
    res.i6_judged = rep.i6_judged
    res.commits = len(c.history.commits)
    res.repairs = sum(1 for r in c.history.commits.values() if r.kind == "repair")
    res.rollbacks = sum(1 for r in c.history.commits.values() if r.kind == "rollback")
    res.wipes = len(c.history.wipes)
    res.wipes_at_genesis = sum(1 for _, _, head in c.history.wipes if head == c.genesis.version)
    res.detect_s = [round(t - t0, 3) for _, t0, t in c.history.detections]
    tk = asdict(c.tokens)
    tk.pop("i4_examples")
    res.tokens = tk
    res.shims = c.shim_totals()
    res.virtual_s = c.clock.now()
    res.cpu_s = time.process_time() - t0
    return res


def run_job(args: tuple[int, int, list[str] | None, dict[str, Any]]) -> dict[str, Any]:
    """One schedule for `python -m chaos run` (picklable for worker processes): (nodes, seed, lines, kw)."""
    import logging

    import torch

    for name in ("agent",):  # each agent logs every fault it sees
        logging.getLogger(name).setLevel(logging.ERROR)
    torch.set_num_threads(1)  # tiny tensors: threads only contend
    nodes, seed, lines, config = args
    kw = dict(config)
    shape = Shape(**kw.pop("shape"))
    t0 = time.process_time()
    try:
        out = run_schedule(nodes, seed, lines, shape, **kw).to_json()
    except Exception:  # noqa: BLE001 - a schedule that raises is a failed schedule, reported, not a dead pool
        import traceback

        out = RunResult(seed, nodes, list(lines or []), cpu_s=time.process_time() - t0).to_json()
        out["error"] = traceback.format_exc(limit=12)
    out["config"] = config  # what --resume compares
    return out
