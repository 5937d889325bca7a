"""Real network faults for the process runner: each agent in a network namespace of its own, all joined by
one switch process, faults applied to the packets the agents' kernels send and receive.

    node k         emoe<tag>n<k>  eth0 = 10.213.<net>.<k+1>/24 (a TAP device), lo up; the agent listens on eth0
    the runner     (root namespace) TAP emoe<tag>r = 10.213.<net>.254/24, for status calls and checks
    the switch     `python -m chaos.wire`, holding the other end of every TAP device (chaos/wire.py)

Partitions and loss are nftables rules in each node's namespace (table `inet emoe`, input hook, so that
packets vanish as on a cut link and no error comes back to the sender): a partition drops every packet from
a peer on the other side; loss drops a random share of incoming packets (`numgen random`). Delay, jitter
(hence reordering) and duplication are the switch's: this machine's kernel has neither the netem qdisc nor
nftables' `queue`, so no rule in it can hold a packet back (chaos/wire.py says more). The shim link is a
unix socket (a path in the file system), which namespaces do not separate.
Everything lives in namespaces and TAP devices this lab creates and `close()` deletes; nothing touches other
interfaces. The addresses are private ones used only inside these namespaces and the runner's TAP into them.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class NetnsError(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, or the kernel refuses); says why."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and r.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def unavailable() -> str:
    """Why network namespaces cannot be used here, or "" when they can."""
    if os.geteuid() != 0:
        return "not root"
    for tool, pkg in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (Debian package {pkg})"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun (TAP devices)"
    probe = f"emoeprobe{os.getpid() % 100000}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"ip netns add: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "nft", "add", "table", "inet", "emoe"], capture_output=True,
                           text=True, timeout=10)
    finally:
        _ip("netns", "del", probe, check=False)
    return "" if r.returncode == 0 else f"nft in a namespace: {r.stderr.strip()}"


class NetLab:
    def __init__(self, n: int, tag: str | None = None) -> None:
        self.n = n
        self.tag = tag or str(os.getpid() % 100000)
        self.net = os.getpid() % 200 + 20  # third octet: concurrent labs on one machine use distinct subnets
        self.nodes = [f"emoe{self.tag}n{k}" for k in range(n)]
        self.root_if = f"emoe{self.tag}r"
        self._made: list[str] = []
        self._cut: dict[int, set[int]] = {k: set() for k in range(n)}  # node -> peers whose packets it drops
        self._loss: dict[int, float] = dict.fromkeys(range(n), 0.0)
        self.wire: subprocess.Popen[str] | None = None

    def addr(self, k: int) -> str:
        return f"10.213.{self.net}.{k + 1}"

    @property
    def runner_addr(self) -> str:
        return f"10.213.{self.net}.254"

    def wrap(self, k: int) -> list[str]:
        """The command prefix that runs a process in node k's namespace."""
        return ["ip", "netns", "exec", self.nodes[k]]

    def tap(self, k: int) -> str:
        return f"emoe{self.tag}t{k}"

    def up(self) -> NetLab:
        try:
            self.wire = subprocess.Popen([sys.executable, "-m", "chaos.wire", *(self.tap(k) for k in range(self.n)),
                                          self.root_if], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True, start_new_session=True)  # ends when its stdin closes, not on ^C
            if self._answer() != "ready":
                raise NetnsError(f"chaos.wire did not start (exit {self.wire.poll()})")
            for k, ns in enumerate(self.nodes):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("link", "set", self.tap(k), "netns", ns)
                _ip("-n", ns, "link", "set", self.tap(k), "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._apply(k)
            _ip("addr", "add", f"{self.runner_addr}/24", "dev", self.root_if)
            _ip("link", "set", self.root_if, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _answer(self, timeout_s: float = 10.0) -> str:
        """The switch's next line on stdout ("" if it exited or said nothing within `timeout_s`)."""
        assert self.wire is not None and self.wire.stdout is not None
        ready, _, _ = select.select([self.wire.stdout], [], [], timeout_s)
        return self.wire.stdout.readline().strip() if ready else ""

    # ---- faults ---------------------------------------------------------------------------------
    def _apply(self, k: int) -> None:
        """Replace node k's rules by what `_cut` and `_loss` say, in one nft transaction."""
        rules = [f"ip saddr {{ {', '.join(self.addr(j) for j in sorted(self._cut[k]))} }} drop"] if self._cut[k] else []
        if self._loss[k] >= 1.0:
            rules.append("drop")
        elif self._loss[k] > 0:
            rules.append(f"numgen random mod 10000 < {round(self._loss[k] * 10000)} drop")
        body = "".join(f"    {r}\n" for r in rules)
        text = (f"table inet emoe\ndelete table inet emoe\ntable inet emoe {{\n  chain input {{\n"
                f"    type filter hook input priority 0; policy accept;\n{body}  }}\n}}\n")
        r = subprocess.run(["ip", "netns", "exec", self.nodes[k], "nft", "-f", "-"], input=text, capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0:
            raise NetnsError(f"nft in {self.nodes[k]}: {r.stderr.strip()}")

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """No packet between nodes of different groups (a node in no group talks to everyone)."""
        gs = [list(g) for g in groups]
        for k in range(self.n):
            self._cut[k] = set()
        for g in gs:
            others = {j for h in gs if h is not g for j in h}
            for k in g:
                self._cut[k] = set(others)
        for k in range(self.n):
            self._apply(k)

    def deafen(self, k: int) -> None:
        """Node k receives nothing from its peers while they still receive from it: a one-way link (a NIC or
        a filter broken in one direction), so that k is declared dead by peers it can still reach."""
        self._cut[k] = set(range(self.n)) - {k}
        self._apply(k)

    def loss(self, p: float, nodes: Iterable[int] | None = None) -> None:
        """Drop a share `p` of the packets each of `nodes` (default all) receives."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"loss {p}: expected 0..1")
        for k in range(self.n) if nodes is None else nodes:
            self._loss[k] = p
            self._apply(k)

    def delay(self, delay_ms: float = 0.0, jitter_ms: float = 0.0, dup: float = 0.0,
              nodes: Iterable[int] | None = None) -> None:
        """The cable of each of `nodes` (default all): every frame to or from the node held `delay_ms` +
        uniform(0, `jitter_ms`) (frames overtake each other when jitter exceeds their spacing; a frame between
        two such nodes is held by both), a share `dup` of them delivered twice; all zero lifts it."""
        if self.wire is None or self.wire.stdin is None:
            raise NetnsError("the lab is not up")
        spec = {"ports": None if nodes is None else sorted(nodes), "delay_ms": delay_ms, "jitter_ms": jitter_ms,
                "dup": dup}
        self.wire.stdin.write(json.dumps(spec) + "\n")
        self.wire.stdin.flush()
        said = self._answer()
        if said != "ok":
            raise NetnsError(f"chaos.wire {spec}: {said or 'no answer'}")

    def stats(self) -> dict[str, int]:
        """The switch's frame counts: forwarded, delayed, duplicated, dropped (empty when it is not up)."""
        if self.wire is None or self.wire.stdin is None or self.wire.poll() is not None:
            return {}
        self.wire.stdin.write('{"stats": true}\n')
        self.wire.stdin.flush()
        try:
            return dict(json.loads(self._answer()))
        except ValueError:
            return {}

    def heal(self) -> None:
        for k in range(self.n):
            self._cut[k] = set()
            self._loss[k] = 0.0
            self._apply(k)
        if self.wire is not None and self.wire.poll() is None:
            self.delay()

    def close(self) -> None:
        """Stop the switch (its TAP devices, the runner's included, go with it), then delete every namespace
        this lab made."""
        if self.wire is not None:
            if self.wire.stdin is not None:
                self.wire.stdin.close()
            try:
                self.wire.wait(10)
            except subprocess.TimeoutExpired:
                self.wire.kill()
                self.wire.wait(10)
            if self.wire.stdout is not None:
                self.wire.stdout.close()
            self.wire = None
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> NetLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
