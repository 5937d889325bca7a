"""The kill/restart soak (issue 49, finding 5): three `emoe agent` processes beside twelve live engine ranks under
steady load, one agent killed with SIGKILL and restarted every few minutes; no commit may follow a kill, and
the agents' memory and open files stay flat.

    python -m chaos.soak [--minutes 25] [--kill-every 300] [--down 10] [--out DIR] [--seed N] [--rate 100]

The pieces are the product's own: the agents are chaos.localcluster.LocalCluster processes (`emoe agent`, the
`local` profile, the demo's shape: 3 nodes x 4 ranks x 6 slots, and its decision section: 50-step windows,
budget 2, theta 1.10, tau 0.02, so that they commit on real skew); the load is `emoe load replay` (a subprocess
for the whole soak: one dataplane_shim.plugin.PluginCore per EP rank over its node's shim socket, stepped in
lockstep) replaying the bundled ESFT intent trace (600 steps, 26 layers x 64 experts, from the start over at its
end) at --rate steps per second (default 100: two windows a second; on the shared 2-core machine this was written
on the replay's 12 ranks took 15% of a core and each agent 6% at that rate, so the agents keep their timing while
other work loads the machine). Every --kill-every seconds one agent (node1, node2, node3 in turn; a seeded
choice with --seed) is killed with SIGKILL, left down --down seconds and restarted on the same data_dir and port,
while its engine ranks keep serving: the replay never stops, and its links reconnect to the new process.

Measured: each kill (when, which node, how long down, when the survivors declared it dead, when it served
again: gRPC health SERVING and closing windows); every commit the agents hold (Admin/History: version, kind,
operations, copy bytes, trigger, commit time); each agent's RSS (/proc/PID/status VmRSS) and open files
(/proc/PID/fd) every --sample-every seconds (a restarted agent's series restarts with its process).

Verdict (exit 1 if any part fails, 0 otherwise; every figure printed and written to DIR/soak.json):
- no commit after a kill: a commit is "after a kill" when it comes between the kill and the end of that kill's
  reach: the later of (down + the dead-node timeout) and (the agent serving again), plus two windows' time, plus
  5 s for scheduling on a loaded machine. The dead-node timeout is the config's bound for a 3-node cluster
  (probe interval + probe timeout x (1 + indirect checks) + the longest suspicion, suspicion_max_mult x its
  minimum): a kill's effects on gossip cannot come later. Any such commit fails the soak, whatever its kind.
- flat RSS: at most +20% over the agent's RSS at the end of the warm-up (the first kill, at most 5 minutes in:
  every agent has then loaded its log, opened its peers' channels and its ranks' links, and filled its replay
  buffer and window history, whose sizes are bounded by config). A Python process's RSS wanders by a few MB as
  its allocator's arenas fill and empty (5-10% of the ~85 MB an agent holds); 20% is twice that, and a leak
  of 6 KB a window (per-window or per-peer-incarnation state kept: 17 MB over the 2,400 windows after the
  warm-up) passes it within the soak.
  A restarted agent's samples in its first `relax` seconds (60 s, or a third of the kill period) are left out
  (it is warming up again), after which they are held to the same bound against its first life's figure.
- flat open files: at most +10 over the warm-up figure (same rules). An agent holds ~28 fds: its log, the
  store, epoll, its listening sockets, about 2 per peer channel and 1 per engine rank link; each kill makes the
  survivors reconnect a peer channel and the restarted agent accept 4 rank links afresh; 10 is a reconnect's
  worth of sockets left over in flight at a sample (gRPC closes the old ones lazily), and a leak of even one fd
  a reconnect passes it over the soak's 4 kills x (1 channel + 4 links).
Every wait is bounded; the agents and the replay are stopped (then killed) in `finally`, Ctrl-C and SIGTERM
included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from chaos.localcluster import ROOT, LocalCluster, stable_ports
from elasticmoe.v1 import admin_pb2 as apb
from elasticmoe.v1 import admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import gossip_pb2 as gpb

NODES, RPN, SLOTS = 3, 4, 6
TRACE = ROOT / "bench" / "data" / "esft-intent-b256.npz"
DECISION = {"window": 50, "budget_windows": 2, "theta": 1.10, "tau": 0.02, "sample_every": 10}  # the demo's
RSS_GROWTH_MAX = 0.20   # relative, over the warm-up figure (docstring: why)
FDS_GROWTH_MAX = 10     # open files over the warm-up figure
SLACK_S = 5.0           # scheduling slack on a loaded machine, added to each kill's reach


@dataclass
class Kill:
    node: str
    at_s: float                      # since the soak started
    at_unix: float
    down_s: float = 0.0              # SIGKILL -> restarted
    dead_after_s: float | None = None   # SIGKILL -> every survivor lists it DEAD (None: not within its down time)
    back_s: float | None = None      # SIGKILL -> gRPC health SERVING again
    serving_s: float | None = None   # SIGKILL -> it closes a new load window again
    reach_s: float = 0.0             # a commit within this many seconds of the kill is "after a kill"


@dataclass
class Commit:
    version: int
    at_s: float | None               # since the soak started (None: the agents did not record its time)
    kind: str
    ops: int
    bytes: int
    trigger: str
    proposer: str
    after_kill: str | None = None    # the node whose kill it follows


@dataclass
class Sample:
    at_s: float
    pid: int
    rss_kb: int
    fds: int


@dataclass
class Series:
    node: str
    samples: list[Sample] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)  # when each life of its process started (since the soak)


def proc_stats(pid: int) -> tuple[int, int] | None:
    """(VmRSS in kB, open files) of a live process; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def status(address: str, timeout: float = 3.0) -> apb.StatusReply | None:
    try:
        with grpc.insecure_channel(address) as ch:
            r: apb.StatusReply = admin_pb2_grpc.AdminStub(ch).Status(  # type: ignore[no-untyped-call]
                apb.StatusRequest(), timeout=timeout)
            return r
    except grpc.RpcError:
        return None


def history(address: str, timeout: float = 10.0) -> list[apb.HistoryEntry] | None:
    try:
        with grpc.insecure_channel(address) as ch:
            r: apb.HistoryReply = admin_pb2_grpc.AdminStub(ch).History(  # type: ignore[no-untyped-call]
                apb.HistoryRequest(limit=10_000), timeout=timeout)
            return list(r.entries)
    except grpc.RpcError:
        return None


def dead_timeout_s(c: LocalCluster) -> float:
    """The longest a crash can take to be declared dead in this 3-node cluster (the agents' own config)."""
    from agent.config import load

    g = load(str(c.configs[0])).gossip
    lo = max(g.suspicion_min_ms / 1e3, g.suspicion_mult * 1.0 * g.probe_interval_ms / 1e3)  # log10(3) < 1
    return (g.probe_interval_ms + g.probe_timeout_ms * (1 + g.indirect_checks)) / 1e3 + g.suspicion_max_mult * lo


class Soak:
    def __init__(self, args: argparse.Namespace, base: Path) -> None:
        self.args = args
        shape = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": SLOTS, "layers": 26, "experts": 64,
                 "top_k": 6}
        # ports below the ephemeral range: each agent restarts on its own port
        self.c = LocalCluster(NODES, base, shape, profile="local", sections={"decision": DECISION},
                              ports=stable_ports(NODES), log_level="INFO")
        self.window_s = DECISION["window"] / args.rate
        self.dead_s = dead_timeout_s(self.c)
        self.series = [Series(n) for n in self.c.ids]
        self.replay_series = Series("replay")
        self.kills: list[Kill] = []
        self.failures: list[str] = []
        self.replay: subprocess.Popen[bytes] | None = None
        self.t0 = time.monotonic()
        self.t0_unix = time.time()
        self.next_sample = 0.0
        self.next_progress = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    # --- the load --------------------------------------------------------------------------------------------
    def start_replay(self) -> None:
        """`emoe load replay` into all three agents for the whole soak (retried while the agents do not yet list
        their ranks, which `load replay` needs)."""
        out, err = self.args.out / "replay.json", self.args.out / "replay.log"
        cmd = [sys.executable, "-m", "agent.cli", "load", "replay", str(TRACE), "--rate", str(self.args.rate),
               "--steps", str(int(self.args.rate * (self.args.minutes * 60 + 120))),
               "--seconds", str(self.args.minutes * 60 + 120), "--sample-every", str(DECISION["sample_every"]),
               "--json"]
        for cfg in self.c.configs:
            cmd += ["--config", str(cfg)]
        deadline = time.monotonic() + 60
        while True:
            with open(out, "wb") as o, open(err, "ab") as e:
                self.replay = subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e, start_new_session=True)
            try:
                rc = self.replay.wait(timeout=5)
            except subprocess.TimeoutExpired:
                return  # feeding
            if time.monotonic() > deadline:
                raise RuntimeError(f"emoe load replay exited with {rc} at its start: see {err}")
            time.sleep(1)

    def replay_line(self) -> str:
        """The replay's newest progress line."""
        try:
            lines = (self.args.out / "replay.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return next((ln.strip() for ln in reversed(lines) if ln.strip().startswith("step ")), "")

    def stop_replay(self) -> dict[str, Any]:
        p = self.replay
        if p is None:
            return {}
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)  # it flushes its last reports and prints its summary
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        try:
            doc: dict[str, Any] = json.loads((self.args.out / "replay.json").read_text())
            return doc
        except (OSError, ValueError):
            return {}

    # --- samples ---------------------------------------------------------------------------------------------
    def sample(self) -> None:
        t = self.now()
        for k, s in enumerate(self.series):
            proc = self.c.procs[k]
            if proc is not None and proc.poll() is None and (st := proc_stats(proc.pid)) is not None:
                s.samples.append(Sample(round(t, 1), proc.pid, *st))
        if self.replay is not None and (st := proc_stats(self.replay.pid)) is not None:
            self.replay_series.samples.append(Sample(round(t, 1), self.replay.pid, *st))
        self.next_sample = t + self.args.sample_every

    def check_alive(self, skip: int | None = None) -> None:
        for k in range(NODES):
            proc = self.c.procs[k]
            if k != skip and proc is not None and proc.poll() is not None:
                raise RuntimeError(f"agent {self.c.ids[k]} exited with {proc.returncode}: see {self.c.log(k)}")
        if self.replay is not None and self.replay.poll() is not None:
            raise RuntimeError(f"the replay exited with {self.replay.returncode}: see {self.args.out / 'replay.log'}")

    def idle_until(self, t_end: float) -> None:
        """Sample on schedule, one progress line a minute, until `t_end` (soak time)."""
        while (t := self.now()) < t_end:
            self.check_alive()
            if t >= self.next_sample:
                self.sample()
            if t >= self.next_progress:
                self.progress()
            time.sleep(min(1.0, max(0.0, t_end - self.now())))

    def progress(self) -> None:
        t = self.now()
        self.next_progress = (int(t // 60) + 1) * 60.0
        cells = []
        for k in range(NODES):
            st = status(self.c.addresses[k], timeout=2.0)
            last = self.series[k].samples[-1] if self.series[k].samples else None
            mem = f", {last.rss_kb / 1024:.0f} MB, {last.fds} fds" if last else ""
            cells.append(f"{self.c.ids[k]} v{st.committed_version} w{st.window_seq}{mem}" if st else
                         f"{self.c.ids[k]} down")
        load = os.getloadavg()[0]
        print(f"[{t / 60:5.1f} min] {'; '.join(cells)}; load {load:.2f}; replay: {self.replay_line() or '-'}",
              flush=True)

    # --- kills -----------------------------------------------------------------------------------------------
    def kill_plan(self) -> list[int]:
        """Which agent each kill takes: node1, node2, node3 in turn, or seeded choices."""
        total, every = self.args.minutes * 60, self.args.kill_every
        # a kill is made only if its whole reach (down, death, return, two windows) fits before the end
        reach = self.args.down + self.dead_s + 2 * self.window_s + SLACK_S + 15
        n = max(0, math.floor((total - reach) / every))
        rng = random.Random(self.args.seed)
        return [rng.randrange(NODES) if self.args.seed is not None else i % NODES for i in range(n)]

    def kill(self, k: int) -> Kill:
        c, node = self.c, self.c.ids[k]
        kill = Kill(node, round(self.now(), 1), time.time())
        t_kill = time.monotonic()
        c.kill(k)
        survivors = [j for j in range(NODES) if j != k]
        while time.monotonic() - t_kill < self.args.down:
            self.check_alive(skip=k)
            if kill.dead_after_s is None and all(
                    (st := status(c.addresses[j], 1.0)) is not None
                    and any(m.node_id == node and m.status == gpb.DEAD for m in st.members) for j in survivors):
                kill.dead_after_s = round(time.monotonic() - t_kill, 1)
            if self.now() >= self.next_sample:
                self.sample()
            time.sleep(0.25)
        c.start(k)
        kill.down_s = round(time.monotonic() - t_kill, 1)
        self.series[k].starts.append(round(self.now(), 1))
        c.wait_healthy(timeout=60, which=[k])
        kill.back_s = round(time.monotonic() - t_kill, 1)
        first = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = status(c.addresses[k], 1.0)
            if st is not None and st.window_seq:
                if first is None:
                    first = st.window_seq
                elif st.window_seq > first:
                    kill.serving_s = round(time.monotonic() - t_kill, 1)
                    break
            time.sleep(0.25)
        if kill.serving_s is None:
            self.failures.append(f"{node} did not close a load window within 60 s of its restart")
        back = kill.serving_s if kill.serving_s is not None else kill.back_s
        kill.reach_s = round(max(kill.down_s + self.dead_s, back) + 2 * self.window_s + SLACK_S, 1)
        return kill

    # --- the run ---------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        a = self.args
        total = a.minutes * 60
        plan = self.kill_plan()
        print(f"soak: {NODES} agents x {RPN} ranks, {TRACE.name} at {a.rate:g} steps/s through `emoe load replay`, "
              f"{total / 60:g} min, {len(plan)} kills (SIGKILL, {a.down:g} s down) every {a.kill_every:g} s; "
              f"dead-node timeout <= {self.dead_s:.1f} s, a window {self.window_s:.2f} s; data in {self.c.base}",
              flush=True)
        self.t0, self.t0_unix = time.monotonic(), time.time()
        for s in self.series:
            s.starts.append(0.0)
        self.start_replay()
        for i, k in enumerate(plan):
            self.idle_until((i + 1) * a.kill_every)
            self.sample()  # each agent just before the kill (the first one ends the warm-up)
            kill = self.kill(k)
            self.kills.append(kill)
            print(f"[{self.now() / 60:5.1f} min] killed {kill.node} at {kill.at_s:.0f} s: dead after "
                  f"{kill.dead_after_s} s, restarted after {kill.down_s} s, SERVING after {kill.back_s} s, closing "
                  f"windows after {kill.serving_s} s", flush=True)
        self.idle_until(total)
        self.sample()
        replay = self.stop_replay()
        commits = self.commits()
        return self.report(commits, replay)

    def commits(self) -> list[Commit]:
        entries: dict[int, apb.HistoryEntry] = {}
        for k in range(NODES):
            for h in history(self.c.addresses[k]) or []:
                entries.setdefault(int(h.version), h)
        out = []
        for v in sorted(entries):
            h = entries[v]
            if v <= 1:
                continue  # the genesis table
            ms = h.committed_at_unix_ms or h.plan.proposed_at_unix_ms
            at = round(ms / 1e3 - self.t0_unix, 1) if ms else None
            kind = cpb.PlanKind.Name(h.plan.kind).removeprefix("PLAN_").lower()
            cm = Commit(v, at, kind, len(h.plan.ops), int(h.copy_bytes), h.plan.trigger, h.proposer)
            for kl in self.kills:
                if at is not None and kl.at_s <= at <= kl.at_s + kl.reach_s:
                    cm.after_kill = kl.node
            out.append(cm)
        return out

    def report(self, commits: list[Commit], replay: dict[str, Any]) -> dict[str, Any]:
        a = self.args
        warm_s = min(300.0, a.kill_every, a.minutes * 60)
        relax_s = min(60.0, a.kill_every / 3)
        memory = {}
        for s in self.series:
            memory[s.node] = growth(s, warm_s, relax_s)
            for what, bound in (("rss", RSS_GROWTH_MAX), ("fds", FDS_GROWTH_MAX)):
                m = memory[s.node]
                if m.get(f"{what}_growth") is not None and m[f"{what}_growth"] > bound:
                    self.failures.append(f"{s.node}: {what} grew {m[f'{what}_growth']} after warm-up (bound {bound})")
        after = [cm for cm in commits if cm.after_kill]
        if after:
            self.failures.append(f"{len(after)} commit(s) after a kill: " + "; ".join(
                f"v{cm.version} {cm.kind} at {cm.at_s} s after {cm.after_kill}'s kill ({cm.trigger[:100]})"
                for cm in after))
        if not replay.get("steps"):
            self.failures.append("`emoe load replay` printed no summary when stopped: see replay.log")
        if any(cm.at_s is None for cm in commits):
            self.failures.append("a commit without a time: cannot tell whether it followed a kill")
        return {
            "args": {"minutes": a.minutes, "kill_every": a.kill_every, "down": a.down, "seed": a.seed,
                     "rate": a.rate, "sample_every": a.sample_every},
            "shape": {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": SLOTS, "trace": TRACE.name,
                      "decision": DECISION},
            "dead_timeout_s": round(self.dead_s, 2), "window_s": self.window_s, "warm_up_s": warm_s,
            "relax_s": relax_s, "bounds": {"rss_growth": RSS_GROWTH_MAX, "fds_growth": FDS_GROWTH_MAX},
            "kills": [asdict(k) for k in self.kills],
            "commits": [asdict(cm) for cm in commits],
            "commits_after_kills": len(after),
            "memory": memory,
            "samples": {s.node: [asdict(x) for x in s.samples] for s in [*self.series, self.replay_series]},
            "replay": replay, "load_avg": list(os.getloadavg()),
            "cluster_dir": str(self.c.base),
            "failures": self.failures, "ok": not self.failures,
        }


def growth(s: Series, warm_s: float, relax_s: float) -> dict[str, Any]:
    """An agent's RSS and open files at the end of the warm-up (its last sample at or before `warm_s`, in its
    first life: the state before the first kill, whose reconnections a sample taken during it would catch), at
    the end, and the largest after the warm-up, leaving out each later life's first `relax_s`."""
    first_life_end = s.starts[1] if len(s.starts) > 1 else math.inf
    base = next((x for x in reversed(s.samples) if x.at_s <= min(warm_s, first_life_end)), None)
    if base is None or not s.samples:
        return {"warm": None, "end": None}

    def settled(x: Sample) -> bool:
        life = max(t for t in s.starts if t <= x.at_s)
        return x.at_s > base.at_s and (life == 0.0 or x.at_s >= life + relax_s)

    post = [x for x in s.samples if settled(x)] or [base]
    end = s.samples[-1]
    rss_max, fds_max = max(x.rss_kb for x in post), max(x.fds for x in post)
    return {"warm": asdict(base), "end": asdict(end), "rss_max_kb": rss_max, "fds_max": fds_max,
            "rss_growth": round(rss_max / base.rss_kb - 1, 4), "rss_end_growth": round(end.rss_kb / base.rss_kb - 1, 4),
            "fds_growth": fds_max - base.fds, "fds_end_growth": end.fds - base.fds, "lives": len(s.starts)}


def print_report(r: dict[str, Any]) -> None:
    print("\nKills")
    print(f"  {'at s':>7} {'node':<6} {'down s':>6} {'dead after s':>12} {'SERVING s':>9} {'windows s':>9} {'reach s':>7}")
    for k in r["kills"]:
        print(f"  {k['at_s']:7.1f} {k['node']:<6} {k['down_s']:6.1f} {fmt(k['dead_after_s']):>12} "
              f"{fmt(k['back_s']):>9} {fmt(k['serving_s']):>9} {k['reach_s']:7.1f}")
    print(f"\nCommits ({len(r['commits'])}; after a kill: {r['commits_after_kills']})")
    print(f"  {'at s':>7} {'v':>4} {'kind':<9} {'ops':>4} {'MB':>8} {'after kill':<10} trigger")
    for cm in r["commits"]:
        print(f"  {fmt(cm['at_s']):>7} {cm['version']:>4} {cm['kind']:<9} {cm['ops']:>4} {cm['bytes'] / 1e6:8.1f} "
              f"{cm['after_kill'] or '-':<10} {cm['trigger'][:90]}")
    print(f"\nMemory and open files (warm-up ends at {r['warm_up_s']:g} s; a restarted agent's first {r['relax_s']:g} s "
          f"left out; bounds +{r['bounds']['rss_growth']:.0%} RSS, +{r['bounds']['fds_growth']} fds)")
    print(f"  {'node':<6} {'lives':>5} {'warm MB':>8} {'end MB':>7} {'max MB':>7} {'growth':>7} "
          f"{'warm fds':>8} {'end fds':>7} {'max fds':>7} {'growth':>6}")
    for node, m in r["memory"].items():
        if m.get("warm") is None:
            print(f"  {node:<6} no samples")
            continue
        w, e = m["warm"], m["end"]
        print(f"  {node:<6} {m['lives']:>5} {w['rss_kb'] / 1024:8.1f} {e['rss_kb'] / 1024:7.1f} "
              f"{m['rss_max_kb'] / 1024:7.1f} {m['rss_growth']:+7.1%} {w['fds']:>8} {e['fds']:>7} {m['fds_max']:>7} "
              f"{m['fds_growth']:+6d}")
    rp = r["replay"]
    if rp:
        print(f"\nreplay: {rp.get('steps')} steps in {rp.get('seconds')} s ({rp.get('rate')} steps/s), "
              f"{rp.get('reports_sent')} reports sent, {rp.get('reports_dropped')} dropped")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in r['load_avg'])}")
    print("\nverdict: " + ("OK" if r["ok"] else "FAILED: " + "; ".join(r["failures"])))


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chaos.soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=25.0)
    p.add_argument("--kill-every", type=float, default=300.0, metavar="S")
    p.add_argument("--down", type=float, default=10.0, metavar="S")
    p.add_argument("--out", type=Path, default=Path("out/soak"), metavar="DIR")
    p.add_argument("--seed", type=int, default=None, help="choose the agent to kill at random (default: in turn)")
    p.add_argument("--rate", type=float, default=100.0, metavar="STEPS_PER_S")
    p.add_argument("--sample-every", type=float, default=30.0, metavar="S")
    args = p.parse_args(argv)
    if args.minutes <= 0 or args.kill_every <= 0 or args.down < 0 or args.rate <= 0 or args.sample_every <= 0:
        p.error("--minutes, --kill-every, --rate and --sample-every must be > 0, --down >= 0")
    args.out.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, Path(tempfile.mkdtemp(prefix="cluster-", dir=args.out)))
    try:
        with soak.c.running(timeout=60):
            report = soak.run()
    finally:
        soak.stop_replay()
    print_report(report)
    (args.out / "soak.json").write_text(json.dumps(report, indent=2))
    print(f"report: {args.out / 'soak.json'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
