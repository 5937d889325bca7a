"""Real network faults for the process runner: each agent in a network namespace of its own, all on one
bridge, faults applied by the kernel.

    hub namespace  emoe<tag>hub   bridge br0, one veth per node (and one to the runner)
    node k         emoe<tag>n<k>  eth0 = 10.213.<net>.<k+1>/24, lo up; the agent listens on eth0
    the runner     (root namespace) veth emoe<tag>r = 10.213.<net>.254/24, for status calls and checks

Faults are nftables rules in each node's namespace (table `inet emoe`, input hook, so that packets vanish
as on a cut link and no error comes back to the sender): a partition drops every packet from a peer on the
other side; loss drops a random share of incoming packets (`numgen random`). Delay, duplication and
reordering need the kernel's netem qdisc; where the kernel has it (`netem_available()`), `delay()` uses
it, and where it does not (this machine's kernel is built without CONFIG_NET_SCH_NETEM) the runner keeps
those three in the transport's fault file and says so in its report. The shim link is a unix socket (a
path in the file system), which namespaces do not separate.
Everything lives in namespaces this lab creates and `close()` deletes; nothing touches other interfaces.
The addresses are private ones used only inside these namespaces and the runner's veth into them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable


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


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay, duplication, reordering)."""
    try:
        with open("/proc/config.gz", "rb") as f:
            import gzip

            return b"CONFIG_NET_SCH_NETEM=" in gzip.decompress(f.read())
    except OSError:
        return shutil.which("tc") is not None  # no config to read: try it


class NetLab:
    def __init__(self, n: int, tag: str | None = None) -> None:
        self.n = n
        self.tag = tag or str(os.getpid() % 100000)
        self.net = os.getpid() % 200 + 20  # third octet: concurrent labs on one machine use distinct subnets
        self.hub = f"emoe{self.tag}hub"
        self.nodes = [f"emoe{self.tag}n{k}" for k in range(n)]
        self.root_if = f"emoe{self.tag}r"
        self._made: list[str] = []
        self._cut: dict[int, set[int]] = {k: set() for k in range(n)}  # node -> peers whose packets it drops
        self._loss: dict[int, float] = dict.fromkeys(range(n), 0.0)

    def addr(self, k: int) -> str:
        return f"10.213.{self.net}.{k + 1}"

    @property
    def runner_addr(self) -> str:
        return f"10.213.{self.net}.254"

    def wrap(self, k: int) -> list[str]:
        """The command prefix that runs a process in node k's namespace."""
        return ["ip", "netns", "exec", self.nodes[k]]

    def up(self) -> NetLab:
        try:
            _ip("netns", "add", self.hub)
            self._made.append(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for k, ns in enumerate(self.nodes):
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", self.hub, "link", "add", f"v{k}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.hub, "link", "set", f"v{k}", "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(k)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                self._apply(k)
            _ip("link", "add", self.root_if, "type", "veth", "peer", "name", "vr", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", "vr", "master", "br0", "up")
            _ip("addr", "add", f"{self.runner_addr}/24", "dev", self.root_if)
            _ip("link", "set", self.root_if, "up")
        except BaseException:
            self.close()
            raise
        return self

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

    def loss(self, p: float, nodes: Iterable[int] | None = None) -> None:
        """Drop a share `p` of the packets each of `nodes` (default all) receives."""
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"loss {p}: expected 0..1")
        for k in range(self.n) if nodes is None else nodes:
            self._loss[k] = p
            self._apply(k)

    def delay(self, k: int, spec: list[str]) -> None:
        """`tc netem` on node k's eth0 (e.g. ["delay", "20ms"]; [] removes it); needs netem_available()."""
        base = ["ip", "netns", "exec", self.nodes[k], "tc", "qdisc"]
        if not spec:
            subprocess.run([*base, "del", "dev", "eth0", "root"], capture_output=True, timeout=10)
            return
        r = subprocess.run([*base, "replace", "dev", "eth0", "root", "netem", *spec], capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0:
            raise NetnsError(f"tc netem {' '.join(spec)} on {self.nodes[k]}: {r.stderr.strip()}")

    def heal(self) -> None:
        for k in range(self.n):
            self._cut[k] = set()
            self._loss[k] = 0.0
            self._apply(k)

    def close(self) -> None:
        """Delete every namespace this lab made (their interfaces go with them) and the runner's veth."""
        _ip("link", "del", self.root_if, check=False)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> NetLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()
