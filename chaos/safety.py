"""Seeded chaos schedules against the quorum commit, on the simulated network; checks every history.

    python -m chaos.safety --schedules 1000 --nodes 64 --seed 1 --json

Each schedule: a cluster of `--nodes` nodes of which 3, 5 or 7 vote (all learn), network loss, duplication,
delay and reordering drawn per schedule, then a short sequence of proposals (round-0 owners, other nodes,
concurrent duels, proposers that crash or are cut off mid-round), partitions, heals, crashes (some tearing
the store's tail), restarts, process stalls and waits (with `--vote-crashes`, also voters killed as their
vote leaves and restarted by a supervisor, their proposer cut off as its commit leaves). At the end every
fault heals and the cluster settles; then chaos/checkers.py checks I1, I2, I3, I7 and linearizability.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field

from agent.config import ConsensusConfig
from agent.consensus.paxos import round0_owner
from chaos.checkers import check
from chaos.quorumsim import QuorumSim


@dataclass
class Result:
    seed: int
    violations: list[str] = field(default_factory=list)
    commits: int = 0
    converged: bool = True
    heads: dict[str, int] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)


def run_schedule(seed: int, nodes: int, steps: int = 14, vote_crashes: float = 0.0) -> Result:
    """`vote_crashes`: the share of proposals during which a voter is killed right after its next granted
    promise or accept has left (its vote counts; after a restart only its store has it)."""
    rng = random.Random(seed)
    voters = min(nodes, rng.choice((3, 5, 5, 7)))
    cfg = ConsensusConfig(accept_timeout_ms=40, sync_interval_ms=250, max_attempts=3)
    c = QuorumSim(nodes, voters, seed, cfg)
    c.net.set_default(loss=rng.choice((0.0, 0.02, 0.1, 0.3)), duplicate=rng.choice((0.0, 0.05, 0.2)),
                      latency=0.0002, jitter=rng.choice((0.001, 0.01, 0.03)),  # jitter reorders messages
                      reorder=rng.choice((0.0, 0.1)), reorder_delay=0.05)
    res = Result(seed)
    acts = res.actions
    for _ in range(steps):
        r = rng.random()
        up = c.up()
        down = sorted(set(c.ids) - set(up))
        if r < 0.40 and up:
            who = rng.choice(up)
            owner = round0_owner(c.nodes[who].head.version + 1, c.voters)
            if owner in up and rng.random() < 0.6:
                who = owner
            c.propose(who)
            acts.append(f"propose {who}")
            if vote_crashes and rng.random() < vote_crashes:  # a voter dies as its vote for this round leaves
                pool = [v for v in c.voters if v in up and v != who]
                if pool:
                    victim = rng.choice(pool)
                    c.crash_after_vote(victim, restart_after=rng.choice((0.005, 0.02, 0.1)))
                    c.isolate_after_commit(who)
                    acts.append(f"crash {victim} after its next vote, isolate {who} as it commits")
            for _ in range(rng.choice((0, 0, 1, 2))):  # a duel: others propose other tables for that version
                other = rng.choice(up)
                if other != who and c.nodes[other].head.version == c.nodes[who].head.version:
                    c.propose(other)
                    acts.append(f"propose {other}")
            if rng.random() < 0.25:  # the proposer fails mid-round: after some accepts, before the commit
                c.run(rng.uniform(0.0003, 0.003))
                if rng.random() < 0.5:
                    c.crash(who)
                    acts.append(f"crash {who} mid-round")
                else:
                    c.net.partition([[who], sorted(set(c.ids) - {who})])
                    acts.append(f"isolate {who} mid-round")
        elif r < 0.52:
            side = set(rng.sample(c.ids, rng.randrange(1, len(c.ids))))
            c.net.partition([sorted(side), sorted(set(c.ids) - side)])
            acts.append(f"partition {len(side)}|{len(c.ids) - len(side)}")
        elif r < 0.60:
            c.net.heal()
            acts.append("heal")
        elif r < 0.72 and up:
            pool = [v for v in c.voters if v in up] if rng.random() < 0.8 else up
            if pool:
                victim = rng.choice(pool)
                tear = rng.random() < 0.5
                c.crash(victim, tear=tear)
                acts.append(f"crash {victim}{' torn' if tear else ''}")
        elif r < 0.84 and down:
            n = rng.choice(down)
            c.restart(n)
            acts.append(f"restart {n}")
        elif r < 0.90 and up:  # a stalled process (GC, SIGSTOP): its timers and messages wait, then run late
            n = rng.choice([v for v in c.voters if v in up] or up)
            secs = rng.choice((0.02, 0.1, 0.3))
            c.net.pause_for(n, secs)
            acts.append(f"pause {n} {secs}s")
        c.run(rng.choice((0.001, 0.005, 0.02, 0.08, 0.2)))
    # heal everything, then let anti-entropy settle and finish stragglers
    c.net.heal()
    c.net.set_default(loss=0.0)
    for n in sorted(set(c.ids) - set(c.up())):
        c.restart(n)
    c.run(1.5)
    owner_up = c.up()[0]
    c.propose(owner_up)  # a last proposal after healing: the healed cluster must make progress
    for _ in range(10):  # settle: at most 5 s of virtual time for every node to hold the same head
        c.run(0.5)
        if len(set(c.heads().values())) == 1:
            break
    res.violations = check(c.history)
    heads = c.heads()
    res.commits = max(heads.values(), default=0) - c.genesis.version
    res.converged = len(set(heads.values())) == 1
    res.heads = {} if res.converged else heads
    for n in c.ids:
        res.violations += [f"I1 at {n}: {m}" for m in c.nodes[n].conflicts]
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m chaos.safety", description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", type=int, default=100)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=14, help="fault/proposal steps per schedule")
    ap.add_argument("--vote-crashes", type=float, default=0.0,
                    help="share of proposals during which a voter dies right after its vote leaves (0..1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    a = ap.parse_args(argv)
    if a.schedules < 1 or a.nodes < 1:
        ap.error(f"--schedules {a.schedules} --nodes {a.nodes}: expected both >= 1")
    if not 0.0 <= a.vote_crashes <= 1.0:
        ap.error(f"--vote-crashes {a.vote_crashes}: expected a share in [0, 1]")
    t0 = time.perf_counter()
    violations = 0
    commits = 0
    unconverged = 0
    for i in range(a.schedules):
        r = run_schedule(a.seed * 1_000_003 + i, a.nodes, a.steps, a.vote_crashes)
        commits += r.commits
        if not r.converged:
            unconverged += 1
            print(f"schedule {i} (seed {r.seed}) did not converge after healing: {r.heads}", file=sys.stderr)
        if r.violations:
            violations += len(r.violations)
            print(f"schedule {i} (seed {r.seed}): {r.violations[:3]} after {r.actions}", file=sys.stderr)
    took = time.perf_counter() - t0
    print(f"{a.schedules} schedules, {commits} commits, {unconverged} not converged after healing, "
          f"{took:.1f} s", file=sys.stderr)
    if a.json:
        print(json.dumps({"schedules": a.schedules, "nodes": a.nodes, "violations": violations}))
    else:
        print(f"schedules={a.schedules} nodes={a.nodes} violations={violations}")
    return 0 if violations == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
