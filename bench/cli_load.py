"""`emoe load replay`: feed a hand-started cluster from a trace, through the engines' real link.

One engine plugin core per EP rank of the agents it is given (dataplane_shim.plugin.PluginCore with its
Installer, the code that runs inside vLLM and SGLang, stepped in lockstep by bench.live.ReplayEngine), each
linked to its own node's agent over that agent's shim socket (dataplane_shim.link.LinkThread): every step, each
rank serves its share of the trace's tokens under the table it runs, reports on the plugins' schedule with
the sampled steps, agrees on a version with the other ranks and installs it. So the agents close windows,
plan, vote and commit as they do beside real engines, and `emoe top`, `explain` and `history` show real data.

The cluster's shape comes from the agents (Status: each agent's node id and ranks; Placement of version 1:
the genesis table, which the plugin cores boot with); each agent's shim socket from its config (`--config`:
`shim_socket`, else `<data_dir>/shim.sock`) or from `--shim-socket`, paired in order with `--agent`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.cli import add_timeout, exits
from agent.cli.argtypes import float_in, int_in


@dataclass
class Node:
    address: str  # admin HOST:PORT
    socket: str   # the agent's shim socket
    node_id: str = ""
    ranks: tuple[int, ...] = ()
    window: int = 0       # its decision.window (steps per load window)
    window_seq: int = 0   # its newest closed cluster window


@dataclass
class Cluster:
    genesis: Any          # controlplane.table.RoutingTable: version 1, what the plugin cores boot with
    window: int           # steps per load window
    first_step: int       # where this feed's steps start: past every given agent's newest window


class LoadError(Exception):
    def __init__(self, message: str, exit: int) -> None:
        super().__init__(message)
        self.exit = exit


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("load", help="feed load into a running cluster (try top, explain and history on real data)")
    lsub = p.add_subparsers(dest="load_command", metavar="ACTION", required=True)
    r = lsub.add_parser(
        "replay", help="replay a trace through the engines' real link into the agents, one plugin core per rank",
        description="Replay TRACE (a native .npz: emoe trace import, or the demo's bench/data/esft-*.npz) into "
                    "running agents through their shim sockets, as engines beside them would: one plugin core per "
                    "rank of each agent given, at --rate steps per second, until --steps or --seconds (or Ctrl-C); "
                    "a line of progress every second on stderr, a summary at the end. Its links do not claim "
                    "their ranks as an engine's do, so stopping it drains nothing.")
    r.add_argument("trace", type=Path, metavar="TRACE", help="a native .npz trace of [steps, layers, experts] counts "
                                                              "whose layers and experts are the cluster's")
    r.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="an agent's config: its listen address and shim socket (repeat for each node to feed)")
    r.add_argument("--agent", action="append", default=[], metavar="HOST:PORT",
                   help="an agent's admin address (repeat; each with its --shim-socket, in the same order)")
    r.add_argument("--shim-socket", action="append", default=[], metavar="PATH",
                   help="the unix socket of the --agent at the same position (its config's shim_socket, or "
                        "<data_dir>/shim.sock)")
    r.add_argument("--rate", type=float_in(0.0, 100_000.0, lo_open=True), default=100.0, metavar="STEPS_PER_S",
                   help="decode steps per second (default 100: two of the agents' 50-step load windows a second)")
    r.add_argument("--steps", type=int_in(1, 10**9), default=None, metavar="N",
                   help="steps to feed (default: the trace's length; past its end the trace starts over)")
    r.add_argument("--seconds", type=float_in(0.0, 10**7, lo_open=True), default=None, metavar="S",
                   help="stop after this many seconds, whatever --steps says")
    r.add_argument("--report-every", type=int_in(1, 1_000_000), default=None, metavar="N",
                   help="steps per load report, the plugins' EMOE_REPORT_EVERY (default: 25, or the largest "
                        "divisor of the agents' decision.window below it, so that each window closes at its last "
                        "step)")
    r.add_argument("--sample-every", type=int_in(0, 1_000_000), default=10, metavar="N",
                   help="the per-step counts of every N-th step travel with the totals (EMOE_SAMPLE_EVERY; "
                        "default 10): set the agents' decision.sample_every (0: totals only)")
    r.add_argument("--agree-every", type=int_in(1, 1_000_000), default=32, metavar="N",
                   help="steps per version agreement among the ranks (EMOE_AGREE_EVERY, default 32)")
    r.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_timeout(r)
    r.set_defaults(func=replay)


def nodes_of(args: argparse.Namespace) -> list[Node]:
    """The agents to feed, from --config files and --agent/--shim-socket pairs; LoadError(2) if bad."""
    from agent.cli.connect import CliError, check_address, config_address
    from agent.config import ConfigError
    from agent.state import load_checked

    if len(args.agent) != len(args.shim_socket):
        raise LoadError(f"{len(args.agent)} --agent and {len(args.shim_socket)} --shim-socket: give one "
                        f"--shim-socket for each --agent, in the same order (or --config per node)", exits.USAGE)
    if not args.agent and not args.config:
        raise LoadError("no agent to feed: give --config FILE, or --agent HOST:PORT with --shim-socket PATH, "
                        "for each node", exits.USAGE)
    out: list[Node] = []
    try:
        for path in args.config:
            try:
                cfg = load_checked(path)
            except ConfigError as e:
                raise LoadError(f"invalid config: {e}", exits.USAGE) from None
            out.append(Node(config_address(path), cfg.shim_socket or str(Path(cfg.data_dir) / "shim.sock")))
        out += [Node(check_address(a, "--agent"), s) for a, s in zip(args.agent, args.shim_socket, strict=True)]
    except CliError as e:
        raise LoadError(str(e), e.exit) from None
    for n in out:
        try:
            mode = os.stat(n.socket).st_mode
        except OSError as e:
            raise LoadError(f"shim socket {n.socket!r} of agent {n.address}: {e.strerror}", exits.USAGE) from None
        if not stat.S_ISSOCK(mode):
            raise LoadError(f"shim socket {n.socket!r} of agent {n.address}: not a unix socket", exits.USAGE)
    return out


def cluster_of(nodes: list[Node], timeout: float) -> Cluster:
    """Each node's id, ranks and load windows (its agent's Status and LoadView), and the genesis table with the
    ranks per node (the first agent's Placement of version 1). LoadError(1 or 3) when an agent cannot say."""
    import grpc

    from agent.cli.connect import channel, rpc_failure
    from controlplane.topology import Topology
    from elasticmoe.codec import table_from_pb
    from elasticmoe.v1 import admin_pb2 as apb
    from elasticmoe.v1 import admin_pb2_grpc

    genesis = None
    for n in nodes:
        try:
            with channel(n.address) as ch:
                stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
                st = stub.Status(apb.StatusRequest(), timeout=timeout)
                view = stub.LoadView(apb.LoadViewRequest(), timeout=timeout)
                if genesis is None:
                    genesis = stub.Placement(apb.PlacementRequest(version=1, layer=-1), timeout=timeout)
        except grpc.RpcError as e:
            what, status = rpc_failure(e, n.address)
            raise LoadError(what, status) from None
        n.node_id, n.window, n.window_seq = st.node_id, int(view.window), int(view.window_seq)
        n.ranks = tuple(sorted(next((m.ranks for m in st.members if m.node_id == st.node_id), [])))
        if not n.ranks:
            raise LoadError(f"agent {n.address} ({st.node_id}) does not list its own ranks yet: try again once "
                            f"`emoe status` shows its members", exits.FAILED)
        if not n.window:
            raise LoadError(f"agent {n.address} ({st.node_id}) does not say its load window (an older agent)",
                            exits.FAILED)
    if genesis is None:
        raise LoadError("no agent to ask", exits.USAGE)
    windows = {n.window for n in nodes}
    if len(windows) > 1:
        raise LoadError(f"the agents' decision.window differ ({sorted(windows)}): one cluster, one window",
                        exits.FAILED)
    tb = genesis.table
    rpn = max(1, genesis.ranks_per_node)
    topo = Topology(tb.slots // tb.slots_per_rank // rpn, rpn, tb.slots_per_rank)
    window = windows.pop()
    # a report into a window an agent has closed is dropped as late: start two windows past the newest
    return Cluster(table_from_pb(tb, topo), window, (max(n.window_seq for n in nodes) + 2) * window)


def replay(args: argparse.Namespace) -> int:
    try:
        return _replay(args)
    except LoadError as e:
        print(f"emoe load replay: {e}", file=sys.stderr)
        return e.exit


def _replay(args: argparse.Namespace) -> int:
    from agent.cli.admin import TIMEOUT_S
    from bench.live import ReplayEngine, genesis_spec
    from controlplane.tracefile import load_trace

    timeout = args.timeout or TIMEOUT_S
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as e:
        raise LoadError(f"trace {str(args.trace)!r}: {e}", exits.USAGE) from None
    nodes = nodes_of(args)
    cluster = cluster_of(nodes, timeout)
    base = cluster.genesis
    if len({n.node_id for n in nodes}) < len(nodes):
        raise LoadError("two of the agents given are the same node: give each node once", exits.USAGE)
    T, L, E = trace.shape
    if (L, E) != (base.layers, base.experts):
        raise LoadError(f"trace {str(args.trace)!r} has {L} layers x {E} experts; the cluster has "
                        f"{base.layers} x {base.experts}", exits.USAGE)
    sockets = {g: n.socket for n in nodes for g in n.ranks}
    missing = sorted(set(range(base.topology.ranks)) - set(sockets))
    if missing:
        print(f"emoe load replay: ranks {missing} get no load (their agents were not given)", file=sys.stderr)
    steps = args.steps or T
    counts = trace.counts
    with _Interrupt() as stop, tempfile.TemporaryDirectory(prefix="emoe-load-") as tmp:
        genesis = genesis_spec(base, Path(tmp))
        # the links do not claim their ranks: stopping the replay is not an engine leaving (no repair drains them)
        engine = ReplayEngine(sockets, base.topology, counts, base, genesis, args.sample_every, args.agree_every,
                              cluster.window, args.report_every, claim=False, first_step=cluster.first_step)
        fed, t0 = 0, time.monotonic()
        versions = [engine.table.version]
        progress = Progress(nodes[0].address, timeout, steps, len(sockets))
        try:
            while not stop.asked and fed < steps and (args.seconds is None or time.monotonic() - t0 < args.seconds):
                if engine.step(counts[fed % T]) is not None:
                    versions.append(engine.table.version)
                fed += 1
                progress.maybe(fed, time.monotonic() - t0, engine.table.version)
                wait = t0 + fed / args.rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
        finally:
            engine.flush()
            time.sleep(0.2)  # the links' senders poll every 20 ms: let the last reports leave
            sent, dropped = engine.reports
            engine.close()
        took = time.monotonic() - t0
        seen = progress.ask()
    interrupted = stop.asked
    doc: dict[str, Any] = {"trace": str(args.trace), "steps": fed, "first_step": cluster.first_step, "seconds": round(took, 3), "rate": round(fed / max(took, 1e-9), 1),
           "ranks": sorted(sockets), "nodes": [n.node_id for n in nodes], "reports_sent": sent,
           "reports_dropped": dropped, "installed_versions": versions,
           "agent": seen or None}
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        print(f"fed {fed} steps of {args.trace.name} in {took:.1f} s ({doc['rate']} steps/s) to {len(sockets)} ranks "
              f"on {', '.join(n.node_id for n in nodes)}; {sent} load reports sent, {dropped} dropped; the ranks installed "
              f"versions {' -> '.join(str(v) for v in versions)}")
        if seen:
            print(f"agent {seen['node']}: committed version {seen['version']}, window {seen['window']}, step "
                  f"imbalance {seen['step_imbalance']}")
    if interrupted:
        return exits.INTERRUPTED
    if not seen or seen["step_imbalance"] == "-":
        print("emoe load replay: the agents closed no load window: check --report-every against their "
              "decision.window and the agents' logs", file=sys.stderr)
        return exits.FAILED
    return exits.OK


class _Interrupt:
    """The first SIGINT (Ctrl-C, or a harness stopping the load) asks the replay to stop feeding: it then flushes
    its last reports and prints its summary whatever it was doing when the signal came. A second SIGINT interrupts
    at once, as Python's default does."""

    def __init__(self) -> None:
        self.asked = False
        self._before: Any = None

    def __enter__(self) -> _Interrupt:
        self._before = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._before)

    def _handle(self, signum: int, frame: object) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True


class Progress:
    """One stderr line a second: steps fed, the rate, the version the ranks run, and what the first agent says."""

    def __init__(self, address: str, timeout: float, steps: int, ranks: int) -> None:
        self.address, self.timeout, self.steps, self.ranks = address, timeout, steps, ranks
        self.next = 1.0

    def ask(self) -> dict[str, Any]:
        """The first agent's committed version, newest window and step imbalance ({} if it does not answer)."""
        import grpc

        from agent.cli.connect import channel
        from agent.cli.render import imbalance
        from elasticmoe.v1 import admin_pb2 as apb
        from elasticmoe.v1 import admin_pb2_grpc

        try:
            with channel(self.address) as ch:
                st = admin_pb2_grpc.AdminStub(ch).Status(  # type: ignore[no-untyped-call]
                    apb.StatusRequest(), timeout=min(self.timeout, 2.0))
        except grpc.RpcError:
            return {}
        return {"node": st.node_id, "version": st.committed_version,
                "window": st.window_seq if st.step_imbalance > 0 else "-", "step_imbalance": imbalance(st.step_imbalance)}

    def maybe(self, fed: int, elapsed: float, version: int) -> None:
        if elapsed < self.next and fed < self.steps:
            return
        self.next = elapsed + 1.0
        seen = self.ask()
        agent = (f"; agent {seen['node']}: version {seen['version']}, window {seen['window']}, step imbalance "
                 f"{seen['step_imbalance']}") if seen else "; agent not answering"
        print(f"  step {fed}/{self.steps}, {fed / max(elapsed, 1e-9):.0f} steps/s, {self.ranks} ranks run version "
              f"{version}{agent}", file=sys.stderr, flush=True)
