"""A simulated cluster of GossipNodes on one SimNetwork and FakeClock: scenario tests, benchmarks, chaos.

Nodes are named n1, n2, ... in the order they are added; each joins through n1 (or through the first node
still up). Everything, network faults included, is reproducible from `seed`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import numpy as np
import numpy.typing as npt

from agent.clock import FakeClock
from agent.config import GossipConfig, from_dict
from agent.gossip.gossip_node import GossipNode, GossipSigner
from agent.gossip.membership import Member, MemberStatus
from agent.transport.sim import LinkSpec, SimNetwork


def profile_gossip(profile: str, **overrides: object) -> GossipConfig:
    """The GossipConfig of a named profile (`lan`, `local`, `test`), with overrides."""
    cfg = from_dict({"node_id": "x", "profile": profile, "gossip": dict(overrides)})
    return cfg.gossip


@dataclass(frozen=True)
class MemberEvent:
    t: float
    observer: str
    member: Member


class GossipSim:
    def __init__(self, seed: int = 0, cfg: GossipConfig | None = None, link: LinkSpec | None = None,
                 shape: tuple[int, int] = (2, 4), header_bytes: int = 0) -> None:
        self.seed = seed
        self.clock = FakeClock()
        self.net = SimNetwork(self.clock, seed, link, header_bytes=header_bytes)
        self.cfg = cfg or profile_gossip("lan")
        self.shape = shape
        self.rng = random.Random(seed ^ 0x5EED)
        self.nodes: dict[str, GossipNode] = {}
        self.crashed: set[str] = set()
        self.left: set[str] = set()
        self.events: list[MemberEvent] = []
        self.record_events = True
        self._window_seq: dict[str, int] = {}
        self.window_listeners: list[Callable[[str, str, int], None]] = []  # (observer, origin, seq)
        self.signers: dict[str, GossipSigner] = {}  # node id -> its key (mTLS: member claims and windows are signed)

    # ---- building -----------------------------------------------------------------------------
    def ids(self) -> list[str]:
        return list(self.nodes)

    def add_nodes(self, n: int, seed_node: str | None = None, warm: bool = False) -> list[str]:
        """Start n nodes that join through `seed_node` (default: the first node up). `warm`: also hand
        every node the full member table at once, as if the join storm were over (large simulations
        skip its O(N^2 log N) rumours this way)."""
        new = []
        for _ in range(n):
            nid = f"n{len(self.nodes) + 1}"
            seeds = {}
            via = seed_node or next((x for x in self.nodes if self.is_up(x)), None)
            if via is not None:
                seeds[via] = f"{via}:7400"
            node = GossipNode(nid, f"{nid}:7400", [len(self.nodes)], self.cfg, self.net.clock(nid),
                              self.net.transport(nid), seeds, rng_seed=self.rng.getrandbits(32), shape=self.shape,
                              signer=self.signers.get(nid))
            node.on_member_change(partial(self._member_event, nid))
            node.on_window(lambda origin, seq, *_, nid=nid: self._window_event(nid, origin, seq))
            self.nodes[nid] = node
            node.start()
            new.append(nid)
        if warm:
            states = [node.membership.state_pb(node.node_id) for node in self.nodes.values()]
            for node in self.nodes.values():
                for st in states:
                    node.membership.apply(st, push_pull=True, rumour_new=False)
        return new

    def _member_event(self, observer: str, m: Member) -> None:
        if self.record_events:
            self.events.append(MemberEvent(self.clock.now(), observer, m))

    def _window_event(self, observer: str, origin: str, seq: int) -> None:
        for cb in self.window_listeners:
            cb(observer, origin, seq)

    # ---- faults and actions -------------------------------------------------------------------
    def is_up(self, nid: str) -> bool:
        """Not crashed and not left (a paused node is up)."""
        return nid not in self.crashed and nid not in self.left

    def up(self) -> list[str]:
        return [n for n in self.nodes if self.is_up(n)]

    def running(self) -> list[str]:
        return [n for n in self.up() if self.net.is_running(n)]

    def crash(self, nid: str) -> None:
        self.crashed.add(nid)
        self.net.crash(nid)

    def pause(self, nid: str, seconds: float | None = None) -> None:
        if seconds is None:
            self.net.pause(nid)
        else:
            self.net.pause_for(nid, seconds)

    def resume(self, nid: str) -> None:
        self.net.resume(nid)

    def leave(self, nid: str) -> None:
        node = self.nodes[nid]
        self.left.add(nid)
        node.leave(on_done=node.stop)

    def partition(self, groups: Iterable[Iterable[str]]) -> None:
        self.net.partition(groups)

    def heal(self) -> None:
        self.net.heal()

    def set_loss(self, p: float) -> None:
        self.net.set_default(loss=p)

    def publish(self, nid: str, seq: int | None = None) -> int:
        """`nid` publishes its next window: counts[l, e] = seq x 100 + node number, deterministic."""
        seq = self._window_seq.get(nid, 0) + 1 if seq is None else seq
        self._window_seq[nid] = seq
        num = int(nid[1:])
        counts = np.full(self.shape, seq * 100 + num, dtype=np.uint32)
        self.nodes[nid].publish_window(seq, (seq - 1) * 100, 100, counts)
        return seq

    def publish_array(self, nid: str, seq: int, counts: npt.NDArray[np.uint32]) -> None:
        self._window_seq[nid] = seq
        self.nodes[nid].publish_window(seq, (seq - 1) * 100, 100, counts)

    # ---- time ---------------------------------------------------------------------------------
    def run(self, seconds: float) -> None:
        self.clock.advance(seconds)

    def tick(self, n: int = 1) -> None:
        self.run(n * self.cfg.interval_ms / 1e3)

    def converged(self) -> bool:
        """Every running node sees every up node alive, every crashed node dead (or forgotten), every left
        node left (or forgotten), at the same incarnations, and holds the same windows of up nodes."""
        run = self.running()
        if not run:
            return True
        ref: tuple[dict[str, tuple[str, int]], dict[str, tuple[int, int]]] | None = None
        for nid in run:
            node = self.nodes[nid]
            view = {m.node_id: (m.status.value, m.incarnation) for m in node.members()}
            for other in self.nodes:
                st = view.get(other, (None, 0))[0]
                if self.is_up(other) and st != MemberStatus.ALIVE:
                    return False
                if other in self.crashed and st not in (MemberStatus.DEAD, None):
                    return False
                if other in self.left and st not in (MemberStatus.LEFT, None):
                    return False
            live_view = {k: v for k, v in view.items() if self.is_up(k)}
            wins = {k: (w.incarnation, w.window_seq) for k, w in node.load_view().windows.items()}
            key = (live_view, wins)
            if ref is None:
                ref = key
            elif key != ref:
                return False
        return True

    def stabilize(self, limit: float = 60.0, step: float | None = None) -> float | None:
        """Run until `converged()` (checked every `step`, default one gossip interval); the time it took,
        or None if it did not within `limit` seconds."""
        step = step or self.cfg.interval_ms / 1e3
        t0 = self.clock.now()
        while True:
            if self.converged():
                return self.clock.now() - t0
            if self.clock.now() - t0 >= limit:
                return None
            self.run(step)


# ---- the scenario vocabulary (tests/scenarios/membership/*.txt; chaos/ speaks it too) --------------------
def node_ids(spec: str) -> list[str]:
    """"1-4" -> [n1, n2, n3, n4]; "3" -> [n3]; "1,3,5-6" -> [n1, n3, n5, n6]."""
    out: list[str] = []
    for part in spec.split(","):
        lo, _, hi = part.strip().lstrip("n").partition("-")
        a = int(lo)
        b = int(hi.lstrip("n")) if hi else a
        out += [f"n{i}" for i in range(a, b + 1)]
    return out


def compact(ids: Iterable[str]) -> str:
    """[n1, n2, n3, n5] -> "n1-n3,n5"."""
    runs: list[list[int]] = []
    for x in sorted(int(i[1:]) for i in ids):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(f"n{a}" if a == b else f"n{a}-n{b}" for a, b in runs)


def duration(s: str) -> float:
    """"2s" -> 2.0, "500ms" -> 0.5."""
    if s.endswith("ms"):
        return float(s[:-2]) / 1e3
    return float(s.rstrip("s"))


class Scenario:
    """Runs scenario commands against a GossipSim and renders what they print."""

    def __init__(self, seed: int = 0, profile: str = "lan") -> None:
        self.sim = GossipSim(seed=seed, cfg=profile_gossip(profile))
        self._history_from = 0

    def run(self, line: str) -> str:
        cmd, *args = line.split()
        fn = getattr(self, "cmd_" + cmd.replace("-", "_"), None)
        if fn is None:
            raise ValueError(f"unknown command {cmd!r}")
        return fn(*args) or "ok"

    def _observers(self, args: tuple[str, ...]) -> list[str]:
        if args:
            return [n for a in args for n in node_ids(a)]
        return self.sim.running()

    # commands: each returns what it prints (None: "ok")
    def cmd_config(self, *kv: str) -> None:
        """config profile=test interval_ms=50: rebuild the (empty) simulation with another config."""
        if self.sim.nodes:
            raise ValueError("config must come before add-nodes")
        opts = dict(x.split("=", 1) for x in kv)
        profile = opts.pop("profile", "lan")
        seed = int(opts.pop("seed", self.sim.seed))
        overrides: dict[str, object] = {k: (float(v) if "." in v else int(v)) for k, v in opts.items()}
        self.sim = GossipSim(seed=seed, cfg=profile_gossip(profile, **overrides))

    def cmd_add_nodes(self, n: str) -> str:
        return "added " + compact(self.sim.add_nodes(int(n)))

    def cmd_tick(self, n: str = "1") -> None:
        self.sim.tick(int(n))

    def cmd_run(self, d: str) -> None:
        self.sim.run(duration(d))

    def cmd_partition(self, *spec: str) -> None:
        groups = " ".join(spec).split("|")
        self.sim.partition([node_ids(g) for g in groups])

    def cmd_heal(self) -> None:
        self.sim.heal()

    def cmd_crash(self, spec: str) -> None:
        for n in node_ids(spec):
            self.sim.crash(n)

    def cmd_pause(self, spec: str, d: str | None = None) -> None:
        for n in node_ids(spec):
            self.sim.pause(n, None if d is None else duration(d))

    def cmd_resume(self, spec: str) -> None:
        for n in node_ids(spec):
            self.sim.resume(n)

    def cmd_leave(self, spec: str) -> None:
        for n in node_ids(spec):
            self.sim.leave(n)

    def cmd_loss(self, p: str) -> None:
        self.sim.set_loss(float(p))

    def cmd_publish(self, spec: str) -> str:
        return "\n".join(f"{n} published window {self.sim.publish(n)}" for n in node_ids(spec))

    def cmd_stabilize(self, limit: str = "60s") -> str:
        t = self.sim.stabilize(duration(limit))
        return f"not converged after {limit}" if t is None else f"converged after {t:.1f}s"

    def cmd_members(self, *who: str) -> str:
        """Each observer's member list, observers with the same view grouped."""
        groups: dict[str, list[str]] = {}
        for o in self._observers(who):
            view = " ".join(f"{m.node_id}:{m.status.value}/{m.incarnation}" for m in
                            sorted(self.sim.nodes[o].members(), key=lambda m: int(m.node_id[1:])))
            groups.setdefault(view, []).append(o)
        return "\n".join(f"{compact(obs)}: {view}" for view, obs in groups.items())

    def cmd_view(self, *who: str) -> str:
        """Each observer's load view: the window seq it holds per live node (- none) and the total."""
        groups: dict[str, list[str]] = {}
        for o in self._observers(who):
            v = self.sim.nodes[o].load_view()
            per = " ".join(f"{n}#{v.windows[n].window_seq if n in v.windows else '-'}"
                           for n in sorted(v.live, key=lambda x: int(x[1:])))
            groups.setdefault(f"{per} total={int(v.total.sum())}", []).append(o)
        return "\n".join(f"{compact(obs)}: {view}" for view, obs in groups.items())

    def cmd_history(self, spec: str) -> str:
        """The states each member held about `spec` since the last `history` (consecutive repeats merged),
        observers with the same history grouped."""
        events = self.sim.events[self._history_from:]
        out = []
        for n in node_ids(spec):
            per: dict[str, list[str]] = {}
            for e in events:
                if e.member.node_id == n:
                    s = f"{e.member.status.value}/{e.member.incarnation}"
                    h = per.setdefault(e.observer, [])
                    if not h or h[-1] != s:
                        h.append(s)
            groups: dict[str, list[str]] = {}
            for o, h in per.items():
                groups.setdefault(" -> ".join(h), []).append(o)
            out += [f"{n} as seen by {compact(obs)}: {h}" for h, obs in groups.items()] or [f"{n}: no changes"]
        self._history_from = len(self.sim.events)
        return "\n".join(out)
