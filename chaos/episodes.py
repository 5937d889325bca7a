"""The process runner's fault episodes (chaos/procrunner.py plays them on real agent processes): which nodes
are killed, paused, partitioned, lose or corrupt their logs, lose their whole data_dir, or fill their disks,
what the network does to their packets (loss, delay with reordering, duplication, one-way links), and for
how long."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Episode:
    kill: list[int] = field(default_factory=list)
    pause: list[int] = field(default_factory=list)
    groups: list[list[int]] = field(default_factory=list)  # partition: no traffic between groups
    deaf: list[int] = field(default_factory=list)  # one-way: these nodes hear no peer, every peer hears them
    loss: float = 0.0  # packet loss on every node's input (namespaces only)
    delay_ms: float = 0.0  # packets through a node's cable held this long plus up to as long again: reordered
    slow: list[int] = field(default_factory=list)  # the nodes delay_ms applies to (empty: all; one: a gray failure)
    dup: float = 0.0  # share of packets delivered twice (namespaces only)
    restart_all: bool = False  # kill -9 of every agent, all restarted at the end of the hold
    lose_store: list[int] = field(default_factory=list)  # kill -9, log lost, restart: rebuild as a learner
    corrupt: list[int] = field(default_factory=list)  # kill -9, a byte flipped mid-log; restart must refuse
    cut_log: list[int] = field(default_factory=list)  # kill -9, the log's last records cut; rebuild as a learner
    disk_full: list[int] = field(default_factory=list)  # the data_dir's tmpfs full for the hold
    # kill -9, the whole data_dir emptied (log and IDENTITY marker: the restart looks new), restart
    wipe_data_dir: list[int] = field(default_factory=list)
    hold_s: float = 1.0

    def describe(self, ids: list[str]) -> str:
        parts = [f"kill -9 {ids[k]}" for k in self.kill] + [f"SIGSTOP {ids[k]}" for k in self.pause]
        if self.groups:
            parts.append("partition " + " | ".join(",".join(ids[k] for k in g) for g in self.groups))
        parts += [f"{ids[k]} hears no peer (one-way)" for k in self.deaf]
        if self.loss:
            parts.append(f"loss {self.loss:.0%}")
        if self.delay_ms:
            where = f"{','.join(ids[k] for k in self.slow)}'s cable" if self.slow else "every cable"
            parts.append(f"delay {self.delay_ms:g}-{2 * self.delay_ms:g} ms on {where} (reordering)")
        if self.dup:
            parts.append(f"duplicate {self.dup:.0%}")
        parts += ["kill -9 every agent"] if self.restart_all else []
        parts += [f"lose the log of {ids[k]}" for k in self.lose_store]
        parts += [f"corrupt the log of {ids[k]}" for k in self.corrupt]
        parts += [f"cut the log of {ids[k]}" for k in self.cut_log]
        parts += [f"fill the disk of {ids[k]}" for k in self.disk_full]
        parts += [f"wipe the data_dir of {ids[k]}" for k in self.wipe_data_dir]
        return f"{'; '.join(parts)} for {self.hold_s:.1f} s"


def make_schedule(rng: random.Random, n: int, net: bool = False, disks: bool = False) -> list[Episode]:
    """One to three episodes; each one or two fault kinds on distinct nodes (`net`: packet loss, delay,
    duplication and one-way links; `disks`: whole-cluster restart and the store faults, and one node's whole
    data_dir wiped in one episode, drawn from a generator of its own so that the episodes drawn from `rng`
    are the ones the seed gave before)."""
    wipe = random.Random(str(rng.getstate())) if disks else None
    out = []
    menu = ["partition", "kill", "pause"] + (["loss", "delay", "duplicate", "one-way"] if net else [])
    menu += ["restart-all", "lose-store", "corrupt", "disk-full", "cut-log"] if disks else []
    for _ in range(rng.randint(1, 3)):
        ep = Episode(hold_s=round(rng.uniform(0.8, 2.5), 2))
        nodes = list(range(n))
        rng.shuffle(nodes)
        kinds = rng.sample(menu, rng.randint(1, 2))
        if "restart-all" in kinds:  # alone: nothing else can happen to a cluster that is all down
            ep.restart_all = True
            out.append(ep)
            continue
        if "loss" in kinds:
            ep.loss = rng.choice((0.05, 0.2, 0.4))
        if "delay" in kinds:
            ep.delay_ms = rng.choice((20.0, 60.0, 150.0, 400.0))
            ep.slow = [nodes[-1]] if rng.random() < 0.5 else []  # one slow node (not popped: it may also fail)
        if "duplicate" in kinds:
            ep.dup = rng.choice((0.1, 0.3))
        for kind, lst in (("lose-store", ep.lose_store), ("corrupt", ep.corrupt), ("disk-full", ep.disk_full),
                          ("cut-log", ep.cut_log)):
            if kind in kinds:
                lst.append(nodes.pop())
        if "partition" in kinds:
            shape = rng.choice(["isolate", "minority", "halves"])
            cut = {"isolate": 1, "minority": (n - 1) // 2, "halves": n // 2}[shape]
            ep.groups = [sorted(nodes[:cut]), sorted(nodes[cut:])]
        if "one-way" in kinds and not ep.groups:
            ep.deaf = [nodes.pop()]
        if "kill" in kinds:
            ep.kill = [nodes.pop()]
        if "pause" in kinds:
            ep.pause = [nodes.pop()]
        out.append(ep)
    return with_wipe(out, n, wipe) if wipe is not None else out


def with_wipe(episodes: list[Episode], n: int, w: random.Random) -> list[Episode]:
    """One of `episodes` (drawn from `w`) also wipes the data_dir of a node no other fault of it touches
    (none when it restarts the whole cluster)."""
    ep = w.choice(episodes)
    busy = set(ep.kill + ep.pause + ep.deaf + ep.lose_store + ep.corrupt + ep.cut_log + ep.disk_full)
    free = [k for k in range(n) if k not in busy]
    if free and not ep.restart_all:
        ep.wipe_data_dir.append(w.choice(free))
    return episodes
