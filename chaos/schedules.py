"""Fault schedules in the scenario vocabulary (etcd-raft testdata style), as files and from a seeded generator.

One command per line, `#` starts a comment:

    add-nodes 8                      the cluster size the file was written for (checked, not applied)
    tick 2s | tick 500ms             advance virtual time
    partition one|minority|majority|ring|bridge     a drawn partition of that kind
    partition n00 n01 | n02 n03      explicit groups (a node named in no group talks to everyone)
    heal                             end partitions, rings and bridges
    crash NODE                       kill -9: only the store's disk survives; `restart NODE` brings it back
    crash NODE after-commit          armed: kill -9 at NODE's next durable commit, before anything more leaves it
                                     (a proposer's Learn included); after-promise | after-accept: right after
                                     its next granted promise or accept has left (simdisks.POINTS)
    rank-loss NODE                   kill -9 of the node and its ranks, for good (settle does not restart it)
    restart NODE | restart all
    restart-cluster                  kill -9 of every node at once, then all restart from their disks (a power
                                     cut, an upgrade of an idle cluster): I7, and commits resume
    restart-cluster rolling          each node in turn: kill -9, 300 ms down, restart, 1 s before the next
    lose-store NODE                  kill -9, the disk replaced (an empty store), restart: it rebuilds as a learner
    wipe-data-dir NODE [POINT]       kill -9, the whole data_dir gone (the store and its IDENTITY marker: the restart
                                     cannot tell it ran before), restart; with a POINT (after-promise | after-accept
                                     | after-commit): armed as for crash, restarted 200 ms after
    cut-log NODE                     kill -9, the log's last 1-4 whole records cut (it still parses): the restart
                                     finds it below its high-water mark and rebuilds as a learner
    corrupt NODE                     kill -9, a byte flipped mid-log: the restart must refuse (naming the offset);
                                     then the operator's repair and a restart that rebuilds from the peers
    disk-full NODE 2s                the node's disk takes nothing more for a while (ENOSPC): votes fail-stop
    pause NODE [2s] | resume NODE    SIGSTOP / SIGCONT (with a duration: resumed after it)
    drop P | duplicate P | reorder P | delay 5ms | clear-link      message faults on every link
    skew NODE RATE                   NODE's clock runs RATE x real time (0.5 slow, 2 fast; 1 ends it): its
                                     timeouts and intervals stretch or shrink, the engines stay in lockstep
    shift drift                      the load drifts: each layer's experts trade popularity (seeded)
    shift against-next-commit        at the next rebalance's commit the load turns against it (chaos/simload.py):
                                     it realises worse than its parent, and must be rolled back (I6)
    drain RANK | restore RANK        operator drain / restore through a live node's admin backend (refusals
                                     are reported, not errors)
    stabilize                        every fault ends (killed nodes restart, armed faults are dropped), then settle:
                                     I5 within a bound

RANK is a rank id or `random` (an active rank to drain, an inactive rank of an up node to restore).
NODE is an id (n03), `random` (an up node), `voter` (the round-0 owner of the next version, the node
most likely to be mid-proposal) or `down` (a crashed node, for restart).
"""

from __future__ import annotations

import random
from pathlib import Path

from agent.consensus.paxos import round0_owner
from chaos import simdisks, simload
from chaos.simcluster import SimCluster

DIR = Path(__file__).parent / "schedules"


class ScheduleError(ValueError):
    """A schedule line that cannot be parsed or applied; names the line."""


def seconds(tok: str) -> float:
    try:
        if tok.endswith("ms"):
            return float(tok[:-2]) / 1000
        return float(tok.rstrip("s"))
    except ValueError:
        raise ScheduleError(f"duration {tok!r}: expected e.g. 2s or 500ms") from None


def parse(text: str) -> list[str]:
    """The command lines of a schedule file (comments and blank lines dropped)."""
    out = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


def load(path: str | Path) -> list[str]:
    return parse(Path(path).read_text())


def files() -> list[Path]:
    return sorted(DIR.glob("*.txt"))


def _node(c: SimCluster, tok: str, rng: random.Random) -> str | None:
    if tok == "random":
        up = c.up()
        return rng.choice(up) if up else None
    if tok == "voter":
        heads = c.heads()
        if not heads:
            return None
        owner = round0_owner(max(heads.values()) + 1, sorted(c.ids))
        return owner if owner in heads else rng.choice(sorted(heads))
    if tok == "down":
        down = sorted(c.down - c.lost)
        return rng.choice(down) if down else None
    if tok not in c.ids:
        raise ScheduleError(f"node {tok!r}: expected one of {c.ids[0]}..{c.ids[-1]}, random, voter or down")
    return tok


def apply(c: SimCluster, line: str, rng: random.Random, settle_limit_s: float = 20.0) -> str:
    """Apply one command to the cluster; returns what it did (for the report)."""
    cmd, *args = line.split()
    try:
        if cmd == "add-nodes":
            if int(args[0]) != len(c.ids):
                raise ScheduleError(f"{line!r}: the cluster has {len(c.ids)} nodes")
            return line
        if cmd == "tick":
            c.run(seconds(args[0]))
            return line
        if cmd == "partition":
            if len(args) == 1 and args[0] in ("one", "minority", "majority", "ring", "bridge"):
                c.partition_kind(args[0], rng)
                return c.history.faults[-1][1]
            groups: list[list[str]] = [[]]
            for a in args:
                if a == "|":
                    groups.append([])
                else:
                    groups[-1].append(_node(c, a, rng) or a)
            c.partition([g for g in groups if g])
            return line
        if cmd == "heal":
            c.heal()
            return line
        if cmd in ("crash", "rank-loss", "wipe-data-dir"):
            n = _node(c, args[0], rng)
            if n is None:
                return f"{cmd} (no node up)"
            if len(args) > 1:  # armed for a step of the protocol
                if cmd == "rank-loss":
                    raise ScheduleError(f"{line!r}: rank-loss takes no point")
                then = (lambda: c.crash(n)) if cmd == "crash" else (lambda: simdisks.wipe_data_dir(c, n, 0.2))
                simdisks.arm(c, n, args[1], then)
                return f"{cmd} {n} {args[1]} (armed)"
            if cmd == "wipe-data-dir":
                return simdisks.wipe_data_dir(c, n)
            c.crash(n, lost=cmd == "rank-loss")
            return f"{cmd} {n}"
        if cmd == "restart":
            targets = sorted(c.down) if args[0] == "all" else [_node(c, args[0], rng)]
            for n in targets:
                if n is not None:
                    c.restart(n)
            done = [t for t in targets if t is not None]
            return f"restart {' '.join(done)}" if done else "restart (no node down)"
        if cmd == "restart-cluster":
            if args and args[0] != "rolling":
                raise ScheduleError(f"{line!r}: expected restart-cluster [rolling]")
            ids = [n for n in c.ids if n not in c.lost]
            if args:
                for n in ids:
                    c.crash(n)
                    c.run(0.3)
                    c.restart(n)
                    c.run(1.0)
            else:
                for n in ids:
                    c.crash(n)
                for n in ids:
                    c.restart(n)
            return line
        if cmd in ("lose-store", "corrupt", "cut-log"):
            n = _node(c, args[0], rng)
            if n is None:
                return f"{cmd} (no node up)"
            if cmd == "corrupt":
                return simdisks.corrupt(c, n, rng)
            if cmd == "cut-log":
                return simdisks.cut_log(c, n, rng)
            return simdisks.lose_store(c, n)
        if cmd == "disk-full":
            n = _node(c, args[0], rng)
            if n is not None:
                simdisks.disk_full(c, n, seconds(args[1]))
            return f"disk-full {n} {args[1]}"
        if cmd == "pause":
            n = _node(c, args[0], rng)
            if n is not None:
                c.pause(n, seconds(args[1]) if len(args) > 1 else None)
            return f"pause {n} {' '.join(args[1:])}".rstrip()
        if cmd == "resume":
            n = _node(c, args[0], rng)
            if n is not None:
                c.resume(n)
            return f"resume {n}"
        if cmd in ("drop", "duplicate", "reorder"):
            key = {"drop": "loss"}.get(cmd, cmd)
            c.link(**{key: float(args[0])})
            return line
        if cmd == "delay":
            c.link(latency=seconds(args[0]))
            return line
        if cmd == "clear-link":
            c.clear_link()
            return line
        if cmd == "skew":
            n = _node(c, args[0], rng)
            rate = float(args[1])
            if not rate > 0:
                raise ScheduleError(f"{line!r}: rate {rate}: expected > 0")
            if n is not None:
                c.skew(n, rate)
            return f"skew {n} x{rate:g}"
        if cmd == "shift":
            if args[0] == "drift":
                return simload.drift(c, rng)
            if args[0] == "against-next-commit":
                return simload.against_next_commit(c, rng)
            raise ScheduleError(f"{line!r}: expected shift drift|against-next-commit")
        if cmd in ("drain", "restore"):
            via = sorted(c.running())
            if not via:
                return f"{cmd}: no running node"
            st = c.states[rng.choice(via)]
            if args[0] == "random":  # an active rank to drain, or an inactive rank of an up node to restore
                active = set(st.head().active_ranks)
                pool = sorted(active) if cmd == "drain" else sorted(
                    g for n in c.up() for g in c.ranks_of[n] if g not in active)
                if not pool:
                    return f"{cmd} random: no candidate rank"
                args = [str(rng.choice(pool))]
            rank = int(args[0])
            try:
                ack = c.admin(lambda: st.manual.drain(rank) if cmd == "drain" else st.manual.restore(rank))
            except TimeoutError as e:  # no answer (e.g. cut off from a quorum): the operator gives up
                return f"{cmd} {rank}: {e}"
            return f"{cmd} {rank}: {'ok v' + str(ack.version) if ack.ok else 'refused: ' + ack.reason}"
        if cmd == "stabilize":
            c.heal_all(restart=True)
            took = c.settle(settle_limit_s)
            return f"stabilize: converged in {took:.2f} s" if took is not None else "stabilize: NOT converged"
    except (IndexError, ValueError) as e:
        if isinstance(e, ScheduleError):
            raise
        raise ScheduleError(f"{line!r}: {e}") from None
    raise ScheduleError(f"{line!r}: unknown command {cmd!r}")


FAULTS = ("partition one", "partition minority", "partition majority", "partition ring", "partition bridge",
          "crash random", "crash voter", "rank-loss random", "pause random", "drop", "duplicate", "reorder",
          "delay", "restart down", "heal", "drain random", "restore random")
# whole-cluster and rolling restarts, lost and corrupt stores, full disks: drawn too with `disks=True` (off by
# default, so that a seed keeps giving the schedule it gave before they existed)
DISK_FAULTS = ("restart-cluster", "restart-cluster rolling", "lose-store random", "corrupt random",
               "disk-full random", "cut-log random")  # and one `wipe-data-dir` a schedule (with_wipe)


# where a data_dir wipe strikes: at once, or at the node's next durable promise, accept or commit
WIPE_POINTS = ("", " after-promise", " after-accept", " after-commit")


def with_wipe(lines: list[str], w: random.Random) -> list[str]:
    """`lines` (a generated schedule) with one data_dir wipe added, drawn from `w` alone, so that the lines
    drawn before are kept as they were. Half the time it is armed before the warm-up, on a new cluster (its
    first commit is the first version's), else after one of the faults (a later version's). Two times in
    three, the next version's round-0 owner is armed to die between its commit's persist and its Learn
    (then only the voters that chose the value know it). The wipe strikes at a node's next durable
    promise, accept or commit, or at once after a tick of its own."""
    out = list(lines)
    end = out.index("stabilize")
    ticks = [i for i in range(2, end) if out[i].startswith("tick")]  # each fault's tick
    at = 1 if w.random() < 0.5 or not ticks else w.choice(ticks) + 1
    armed = ["crash voter after-commit"] if w.random() < 2 / 3 else []
    point = w.choice(WIPE_POINTS)
    wait = [] if point else ["tick " + w.choice(("300ms", "1s"))]  # on a new cluster: before or after v2
    out[at:at] = armed + wait + ["wipe-data-dir random" + point]
    return out


# a drift, and the load turning against the rebalance that answers it; 12 s: its N + grace windows close
SHIFTS = ["shift against-next-commit", "shift drift", "tick 12s", "stabilize"]


def generate(rng: random.Random, nodes: int, faults: int = 3, skew: bool = False, disks: bool = False,
             shifts: bool = True) -> list[str]:
    """A seeded schedule: a warm-up under load, `faults` faults each followed by a tick (overlapping faults
    are allowed: a partition may still be in force when a node crashes), then stabilize. `skew`: clock
    rate skew joins the faults drawn from, `disks` the DISK_FAULTS (both off by default, so that a seed keeps
    giving the same schedule). `shifts`: then SHIFTS, a load drift whose rebalance the load turns against as
    it commits, so that I6 needs a rollback (it draws nothing here: the schedule before it is unchanged).
    `disks` also adds one data_dir wipe (with_wipe), from a generator of its own seeded by `rng`'s state:
    the lines drawn from `rng` stay the same (their run does not: the wipe changes what follows it)."""
    wrng = random.Random(str(rng.getstate())) if disks else None
    menu = FAULTS + (("skew random",) if skew else ()) + (DISK_FAULTS if disks else ())
    out = [f"add-nodes {nodes}", "tick " + rng.choice(("1500ms", "2s", "3s"))]
    for _ in range(faults):
        f = rng.choice(menu)
        if f == "pause random":
            f += " " + rng.choice(("500ms", "1s", "3s"))
        elif f == "drop":
            f += f" {rng.choice((0.02, 0.1, 0.3))}"
        elif f in ("duplicate", "reorder"):
            f += f" {rng.choice((0.05, 0.2))}"
        elif f == "delay":
            f += " " + rng.choice(("2ms", "20ms", "100ms"))
        elif f == "disk-full random":
            f += " " + rng.choice(("500ms", "2s"))
        elif f == "skew random":
            f += " " + rng.choice(("0.5", "0.8", "1.25", "2"))
        out.append(f)
        out.append("tick " + rng.choice(("300ms", "1s", "2s", "3s")))
        if rng.random() < 0.3:
            out.append(rng.choice(("heal", "clear-link")))
    out.append("stabilize")
    out.append("tick 2s")  # a little load after healing: commits resume and must keep converging
    out.append("stabilize")
    if shifts:
        out += SHIFTS
    return with_wipe(out, wrng) if wrng is not None else out
