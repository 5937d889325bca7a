"""A local cluster of real agent processes on loopback: for the demo, tests, benchmarks and chaos."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while inside, where its action is the default one
    (a caller with its own handler, as chaos's event loop, keeps it)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound then released; from the ephemeral range, so a process
    restarted later may find its port taken by an outgoing connection: see stable_ports)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def write_config(path: Path, top: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
    for name, sec in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml(v)}" for k, v in sec.items()]
    path.write_text("\n".join(lines) + "\n")


def stable_ports(n: int, lo: int = 20000, hi: int = 32000) -> list[int]:
    """n free TCP ports on 127.0.0.1 below Linux's default ephemeral range (32768-60999), so that no
    outgoing connection takes one while its agent is down (kill -9 then restart); random start, bounded scan."""
    import random

    out: list[int] = []
    start = random.randrange(lo, hi)
    for i in range(hi - lo):
        port = lo + (start - lo + i) % (hi - lo)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == n:
            return out
    raise OSError(f"no {n} free ports in {lo}-{hi}")


class LocalCluster:
    """n `emoe agent` processes on 127.0.0.1 with their own data dirs under `base`."""

    def __init__(self, n: int, base: Path, cluster: dict[str, Any], profile: str = "test",
                 sections: dict[str, dict[str, Any]] | None = None, log_level: str = "WARNING",
                 ports: list[int] | None = None, hosts: list[str] | None = None,
                 wrap: list[list[str]] | None = None, faults_file: str | None = None,
                 code: list[Path] | None = None) -> None:
        """`hosts`: each agent's address (default 127.0.0.1); `wrap`: a command prefix per agent (say
        `ip netns exec NS`, to run it in a network namespace of its own); `faults_file`: run each agent through
        chaos.agentproc, its transport dropping the links that file lists (chaos.faults); `code`: the source
        tree each agent runs (default this one; another release's, extracted, for the rolling-upgrade test),
        its working directory and PYTHONPATH, so that its imports come from there; set `code[k]` before a
        restart to run another tree on the same data_dir and ports."""
        self.faults_file = faults_file
        self.code = [ROOT] * n if code is None else [Path(c) for c in code]
        self.n = n
        self.base = Path(base)
        self.ports = free_ports(n) if ports is None else list(ports)
        # node1..node9, or node01..node18: ids that sort as strings in index order, so that agent i owns ranks
        # i * ranks_per_node.. (agents with `ranks` unset own the ranks of their place in that order)
        self.ids = [f"node{i + 1:0{len(str(n))}d}" for i in range(n)]
        self.hosts = list(hosts) if hosts is not None else ["127.0.0.1"] * n
        self.wrap = list(wrap) if wrap is not None else [[] for _ in range(n)]
        self.addresses = [f"{h}:{p}" for h, p in zip(self.hosts, self.ports, strict=True)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self._logs: list[Any] = [None] * n
        self.configs: list[Path] = []
        self.log_level = log_level
        seeds = [f"{i}@{a}" for i, a in zip(self.ids, self.addresses, strict=True)]
        for i in range(n):
            d = self.base / self.ids[i]
            d.mkdir(parents=True, exist_ok=True)
            cfg = d / "agent.toml"
            top = {"node_id": self.ids[i], "profile": profile, "listen": self.addresses[i], "seeds": seeds,
                   "data_dir": str(d / "data"), "shim_socket": str(d / "shim.sock")}
            write_config(cfg, top, {"cluster": cluster, **(sections or {})})
            self.configs.append(cfg)

    def shim_socket(self, i: int) -> str:
        return str(self.base / self.ids[i] / "shim.sock")

    def start(self, i: int | None = None) -> None:
        for k in range(self.n) if i is None else [i]:
            if self._logs[k] is not None:
                self._logs[k].close()
            log = self._logs[k] = open(self.base / self.ids[k] / "agent.log", "ab")  # noqa: SIM115 - closed in stop()
            run = (["-m", "agent.cli", "agent"] if self.faults_file is None
                   else ["-m", "chaos.agentproc", "--faults", self.faults_file])
            self.procs[k] = subprocess.Popen(
                [*self.wrap[k], sys.executable, *run, "--config", str(self.configs[k])],
                cwd=self.code[k], stdout=log, stderr=subprocess.STDOUT, env=self.env(k), start_new_session=True,
            )

    def env(self, k: int) -> dict[str, str]:
        """The environment agent k starts with (run in `code[k]`, its working directory)."""
        env = {**os.environ, "EMOE_LOG": self.log_level, "PYTHONUNBUFFERED": "1"}
        if self.code[k] != ROOT:  # that tree alone: nothing of this one may fill in what it lacks
            env["PYTHONPATH"] = str(self.code[k])
        return env

    def wait_healthy(self, timeout: float = 30.0, which: list[int] | None = None) -> None:
        deadline = time.monotonic() + timeout
        for k in range(self.n) if which is None else which:
            while True:
                proc = self.procs[k]
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"agent {self.ids[k]} exited with {proc.returncode}: see {self.log(k)}")
                if self.healthy(k):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"agent {self.ids[k]} not SERVING after {timeout} s: see {self.log(k)}")
                time.sleep(0.1)

    def healthy(self, k: int) -> bool:
        try:
            with grpc.insecure_channel(self.addresses[k]) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False

    def log(self, k: int) -> Path:
        return self.base / self.ids[k] / "agent.log"

    def signal(self, k: int, sig: int) -> None:
        proc = self.procs[k]
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def kill(self, k: int) -> None:
        """kill -9."""
        self.signal(k, signal.SIGKILL)
        proc = self.procs[k]
        if proc is not None:
            proc.wait(timeout=10)

    def terminate(self, k: int, timeout: float = 15.0) -> int:
        """SIGTERM agent k (it drains, then closes) and wait for it to exit; its exit status (TimeoutError if it
        did not exit in time: then it is killed)."""
        proc = self.procs[k]
        if proc is None:
            raise RuntimeError(f"agent {self.ids[k]} was never started")
        self.signal(k, signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
            raise TimeoutError(f"agent {self.ids[k]} did not exit within {timeout} s of SIGTERM") from None

    def stop(self, timeout: float = 10.0) -> None:
        for k in range(self.n):
            self.signal(k, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        for k, f in enumerate(self._logs):
            if f is not None:
                f.close()
                self._logs[k] = None

    @contextmanager
    def running(self, timeout: float = 60.0) -> Iterator[LocalCluster]:
        """Start every agent, wait until all of them serve, and stop them all on the way out. The agents run in
        sessions of their own (a signal to the caller's process group does not reach them), so, in the main
        thread of a process whose SIGTERM still has its default action, SIGTERM meanwhile interrupts the
        caller as Ctrl-C does (KeyboardInterrupt): the agents are stopped, not left running."""
        with _sigterm_interrupts():
            try:
                self.start()
                self.wait_healthy(timeout=timeout)
                yield self
            finally:
                self.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
