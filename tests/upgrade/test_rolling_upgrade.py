"""A rolling upgrade under load: 3 agents of the previous release (PREVIOUS, extracted from git) under mutual
TLS, fed by one engine plugin core per EP rank over the shim link (this tree's plugin: agents of both releases
serve it, its messages did not change), are replaced one at a time by this tree's agent (SIGTERM, wait for the
exit, start the new code on the same data_dir and ports). After each replacement every agent, the restarted one
included, must commit a new rebalance of the load; a table proposed by one release must be accepted by a voter
of the other; no agent may log that it could not read or verify what a peer (or the other release, on the same
data_dir) wrote. Last, one node goes back to the previous release on the data_dir the new one wrote (a
downgrade) and the rebalances continue.

It runs for real what elasticmoe/versions.py promises: a release and the one before it interoperate. A new RPC
that the previous release answers UNIMPLEMENTED, or a field it skips, must not stop the commits either."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from agent.security import channel_credentials, channel_options, write_dev_certs
from chaos.localcluster import LocalCluster, stable_ports
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import PluginCore
from elasticmoe.v1 import admin_pb2, admin_pb2_grpc
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.versions import WIRE_KEY, WIRE_VERSION
from tests.conftest import until

pytestmark = pytest.mark.slow

# The previous release: the last commit landed on main before this one. Move it forward when a release lands
# (to the commit this tree's first parent on main is); EMOE_UPGRADE_FROM overrides it (a commit or a tag).
PREVIOUS = os.environ.get("EMOE_UPGRADE_FROM", "67b8e7033f3d2620af96491153f7b4b266fea8cc")

ROOT = Path(__file__).resolve().parents[2]
L, E, NODES, RPN, S = 2, 8, 3, 2, 4
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": 2}
# keys both releases' configs accept (a key the older one lacks would stop it at start: forbid_unknown_fields)
DECISION = {"window": 10, "sample_every": 5, "budget_windows": 1, "theta": 1.05, "tau": 0.01}
# what an agent must never log in a mixed cluster: an error, or that it could not read or verify something a
# peer (or the other release, on the same data_dir) wrote
UNREADABLE = re.compile(r"Traceback|\bERROR\b|refused a load window \((unsigned|bad_signature)\)|refused a member "
                        r"state|does not decode|malformed|corrupt|unknown record|newer release|wire version")


def _previous_tree(dest: Path) -> Path:
    """PREVIOUS's tree extracted under `dest` (skips when git, the history or the commit is missing)."""
    if shutil.which("git") is None:
        pytest.skip("git not found: the rolling-upgrade test extracts the previous release with git archive")
    top = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout (an sdist or an installed copy): no previous release to run")
    have = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{PREVIOUS}^{{commit}}"], capture_output=True)
    if have.returncode != 0:
        pytest.skip(f"the previous release {PREVIOUS} is not in this clone's history (a shallow clone? "
                    f"`git fetch --unshallow`, or set EMOE_UPGRADE_FROM)")
    out = dest / "previous"
    out.mkdir()
    archive = dest / "previous.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", PREVIOUS], stdout=f, check=True, timeout=60)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    archive.unlink()
    return out


def _wire_of_tree(tree: Path) -> int:
    """The wire version a release's tree sends (elasticmoe/versions.py WIRE_VERSION; 0: a release before wire
    versions, whose agents answer with none)."""
    src = tree / "elasticmoe" / "versions.py"
    m = re.search(r"^WIRE_VERSION\s*=\s*(\d+)", src.read_text(), re.M) if src.exists() else None
    return int(m.group(1)) if m else 0


def _runs(c: LocalCluster, k: int) -> Path:
    """The tree agent k imports the agent from, started as LocalCluster starts it."""
    r = subprocess.run([sys.executable, "-c", "import agent, elasticmoe.v1; print(agent.__file__)"], cwd=c.code[k],
                       env=c.env(k), capture_output=True, text=True, timeout=60, check=True)
    return Path(r.stdout.strip()).resolve().parents[1]


class Admin:
    """The admin Status of each agent over mutual TLS (the `admin` identity), with the wire version the agent
    answered with (0: none, an agent of a release before wire versions)."""

    def __init__(self, c: LocalCluster, certs: Path) -> None:
        self.c, self.certs = c, certs

    def status(self, k: int, timeout: float = 3.0) -> tuple[admin_pb2.StatusReply, int] | None:
        creds = channel_credentials(self.certs, "admin")
        try:
            with grpc.secure_channel(self.c.addresses[k], creds, options=channel_options()) as ch:
                stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
                reply, call = stub.Status.with_call(admin_pb2.StatusRequest(), timeout=timeout)
                wire = dict(call.initial_metadata() or ()).get(WIRE_KEY, "0")
                return reply, int(wire)
        except grpc.RpcError:
            return None

    def switch(self, k: int, paused: bool) -> admin_pb2.AdminAck:
        """`emoe pause` (or resume) through agent k."""
        with grpc.secure_channel(self.c.addresses[k], channel_credentials(self.certs, "admin"),
                                 options=channel_options()) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
            call = stub.Pause if paused else stub.Resume
            return call(admin_pb2.Empty(), timeout=20)  # type: ignore[no-any-return]

    def paused(self) -> list[bool | None]:
        """Each agent's pause switch as its Status says (None: no answer)."""
        return [None if (st := self.status(k)) is None else bool(st[0].paused) for k in range(self.c.n)]

    def history(self, k: int) -> list[admin_pb2.HistoryEntry]:
        with grpc.secure_channel(self.c.addresses[k], channel_credentials(self.certs, "admin"),
                                 options=channel_options()) as ch:
            stub = admin_pb2_grpc.AdminStub(ch)  # type: ignore[no-untyped-call]
            return list(stub.History(admin_pb2.HistoryRequest(limit=1000), timeout=10).entries)

    def head(self, k: int) -> int:
        st = self.status(k)
        return -1 if st is None else int(st[0].committed_version)

    def wait_serving(self, k: int, wire: int, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            proc = self.c.procs[k]
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{self.c.ids[k]} exited with {proc.returncode}:\n{self.c.log(k).read_text()}")
            st = self.status(k)
            if st is not None and st[0].health == "SERVING":
                assert st[1] == wire, f"{self.c.ids[k]} answers wire version {st[1]}, expected {wire}"
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.c.ids[k]} not SERVING within {timeout} s:\n{self.c.log(k).read_text()}")
            time.sleep(0.2)

    def rebalances_past(self, past: int, what: str, timeout: float = 40.0) -> None:
        """Wait until every agent's committed head is above `past` and a rebalance of the load above `past` is
        among them (not only a restart's own restore or repair)."""
        deadline = time.monotonic() + timeout
        while True:
            heads = [self.head(k) for k in range(self.c.n)]
            if min(heads) > past and any(h.version > past and h.plan.kind == cpb.PLAN_REBALANCE
                                         for h in self.history(int(np.argmin(heads)))):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: no rebalance committed on every agent past version {past} within "
                                     f"{timeout} s (heads {heads})")
            time.sleep(0.3)


class Engines:
    """One plugin core per EP rank over its node's shim socket, stepping in lockstep on a thread: a hot expert
    that moves every `period` steps (so the agents keep finding rebalances to commit), reports, the MIN
    agreement and installs."""

    def __init__(self, c: LocalCluster, period: int = 150) -> None:
        topo = Topology(NODES, RPN, S)
        boot = genesis_table("static", topo, L, E).phy2log
        self.links = [LinkThread(c.shim_socket(g // RPN), 1, shim_id=f"rank{g}", ranks=[g]) for g in range(topo.ranks)]
        self.cores = [PluginCore(link, topo, L, E, g, boot, genesis="static", report_every=5,  # type: ignore[arg-type]
                                 sample_every=5) for g, link in enumerate(self.links)]
        self.period, self.steps, self.installed = period, 0, 1
        self.stop, self.errors = threading.Event(), list[BaseException]()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                load = np.ones((L, E), np.int64)
                load[:, (self.steps // self.period) % E] = 60
                for core in self.cores:
                    offs = core.sampled(1)
                    core.add_load(load, 1, load[None] if offs else None)
                    core.maybe_report()
                red = np.min([core.agreement_vector() for core in self.cores], axis=0)
                for core in self.cores:
                    if (t := core.decide(red)) is not None:
                        core.installed(t.version)
                        self.installed = t.version
                self.steps += 1
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.errors.append(e)

    def close(self) -> None:
        self.stop.set()
        self._th.join(5)
        for link in self.links:
            link.close()


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    out = tmp_path / "tls"
    write_dev_certs(out, [f"node{i + 1}" for i in range(NODES)], ["admin"])
    return out


@pytest.fixture
def cluster(tmp_path: Path, certs: Path) -> Iterator[tuple[LocalCluster, Path]]:
    old = _previous_tree(tmp_path)
    c = LocalCluster(NODES, tmp_path / "cluster", {**SHAPE}, profile="test", ports=stable_ports(NODES),
                     sections={"decision": DECISION, "tls": {"cert_dir": str(certs)}}, code=[old] * NODES)
    assert _runs(c, 0) == old.resolve(), "an agent of the previous release would not run its own tree"
    try:
        yield c, old
    finally:
        c.stop()


Mark = tuple[str, int, tuple[str, ...]]  # a phase: its name, the newest version when it began, each node's release


def _phase(marks: list[Mark], version: int) -> int:
    """The phase (index into marks) in which `version` was committed: the last one it is newer than."""
    return max(i for i, (_, past, _) in enumerate(marks) if version > past)


def test_rolling_upgrade_under_load(cluster: tuple[LocalCluster, Path], certs: Path) -> None:
    c, old = cluster
    t0 = time.monotonic()
    admin = Admin(c, certs)
    c.start()
    old_wire = _wire_of_tree(old)
    for k in range(NODES):
        admin.wait_serving(k, wire=old_wire)
    engines = Engines(c)
    marks: list[Mark] = [("previous release", 1, ("old",) * NODES)]
    releases = ["old"] * NODES
    try:
        admin.rebalances_past(1, "the previous release's cluster under load")
        steps = [(k, ROOT, "new", f"{c.ids[k]} upgraded") for k in range(NODES)]  # one node at a time
        steps.append((0, old, "old", "node1 downgraded"))  # back, on the data_dir the new release wrote
        for k, code, release, what in steps:
            assert c.terminate(k) == 0, f"{c.ids[k]} did not exit cleanly on SIGTERM:\n{c.log(k).read_text()}"
            c.code[k], releases[k] = code, release
            assert _runs(c, k) == code.resolve(), f"{c.ids[k]} would not run {code}"
            c.start(k)
            admin.wait_serving(k, wire=WIRE_VERSION if release == "new" else old_wire)
            past = max(admin.head(j) for j in range(NODES))
            marks.append((what, past, tuple(releases)))
            if len(set(releases)) == 2 and k == 0:
                # the pause switch across releases: a new writer with old voters' unsigned acks, and an old
                # writer (who collects no signatures) naming a new voter; every agent of both follows each
                for writer, on in ((0, True), (NODES - 1, False)):
                    ack = admin.switch(writer, on)
                    assert ack.ok, f"{'pause' if on else 'resume'} through {c.ids[writer]}: {ack.reason}"
                    until(f"every agent {'paused' if on else 'resumed'} ({c.ids[writer]} wrote it)",
                          lambda on=on: admin.paused() == [on] * NODES)  # type: ignore[misc]
            admin.rebalances_past(past, what)
        history = sorted(admin.history(1), key=lambda h: h.version)
        assert not engines.errors, engines.errors
        until("the engines install what the mixed cluster committed", lambda: engines.installed > marks[-1][1])
    finally:
        engines.close()
    c.stop()
    bad = {c.ids[k]: [ln for ln in c.log(k).read_text().splitlines() if UNREADABLE.search(ln)] for k in range(NODES)}
    assert not any(bad.values()), bad

    assert [h.version for h in history] == list(range(2, history[-1].version + 1)), "a gap in the history"
    phases = [[h for h in history if _phase(marks, h.version) == i] for i in range(len(marks))]
    summary = "; ".join(f"{what} (from v{past + 1}): " + ", ".join(
        f"v{h.version} {cpb.PlanKind.Name(h.plan.kind).removeprefix('PLAN_').lower()} by {h.proposer} "
        f"[{' '.join(v.voter for v in h.votes if v.accept)}]" for h in hs)
        for (what, past, _), hs in zip(marks, phases, strict=True))
    print(f"rolling upgrade from {PREVIOUS[:10]} in {time.monotonic() - t0:.1f} s: {summary}")
    # in the phases with both releases, a voter of one release accepted a table the other proposed
    node = {n: i for i, n in enumerate(c.ids)}
    across = [h.version for i, hs in enumerate(phases) for h in hs if len(set(marks[i][2])) == 2
              if any(marks[i][2][node[v.voter]] != marks[i][2][node[h.proposer]] for v in h.votes if v.accept)]
    assert across, f"no table of one release accepted by a voter of the other: {summary}"
