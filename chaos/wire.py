"""The switch between the process runner's network namespaces, with delay, jitter and duplication.

This kernel has neither the netem qdisc nor nftables' `queue` (checked: `tc qdisc ... netem` and
`nft ... queue` are refused), so nothing in it can hold a packet back. Each namespace's eth0 is instead a TAP
device whose other end is this process: a learning Ethernet switch that forwards every frame at once, or,
through a port given a delay, after `delay + uniform(0, jitter)` (so that frames overtake each other:
reordering), sending a share `dup` of them twice; a port's fault is its cable's, in both directions. The
agents' own kernels see the result: TCP retransmits, duplicate segments, out-of-order delivery and slow
handshakes are theirs to handle, as on a slow network. Loss and partitions stay nftables rules inside each
namespace (chaos/netns.py).

    python -m chaos.wire TAP0 TAP1 ...     creates the TAP devices (this network namespace), prints "ready"

then reads one JSON object per line on stdin, {"ports": [k, ...] | null (all), "delay_ms": d, "jitter_ms": j,
"dup": p}, which sets the fault on those ports' cables (every frame to or from them), and answers "ok" (or
"error: ...") on stdout; {"stats": true} answers the frame counts (forwarded, delayed, duplicated, dropped)
as JSON. It exits when stdin closes, and its TAP devices go with it. Frames a port cannot take (its queue
full) are dropped, as a switch would.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import json
import os
import random
import selectors
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_DELAY_MS = 10_000.0
BROADCAST = b"\xff" * 6


def open_tap(name: str) -> int:
    """A new TAP device `name` in this process's network namespace; the returned fd is its wire end."""
    if not 0 < len(name.encode()) < 16:
        raise ValueError(f"TAP name {name!r}: expected 1-15 bytes")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Link:
    """What one port's cable does to the frames through it, both ways: a frame from port a to port b is
    held by a's cable and then by b's (so a delay on every port holds each frame twice), and may be
    duplicated by either."""

    __slots__ = ("delay_s", "jitter_s", "dup")

    def __init__(self) -> None:
        self.delay_s = self.jitter_s = self.dup = 0.0

    def set(self, spec: dict[str, object]) -> None:
        delay, jitter, dup = (float(spec.get(k) or 0.0) for k in ("delay_ms", "jitter_ms", "dup"))  # type: ignore[arg-type]
        for name, v, hi in (("delay_ms", delay, MAX_DELAY_MS), ("jitter_ms", jitter, MAX_DELAY_MS), ("dup", dup, 1.0)):
            if not 0.0 <= v <= hi:
                raise ValueError(f"{name} {v}: expected 0..{hi:g}")
        self.delay_s, self.jitter_s, self.dup = delay / 1000, jitter / 1000, dup

    def hold(self, rng: random.Random) -> float:
        return self.delay_s + (rng.uniform(0.0, self.jitter_s) if self.jitter_s else 0.0)

    @property
    def idle(self) -> bool:
        return self.delay_s == 0.0 and self.jitter_s == 0.0 and self.dup == 0.0


class Switch:
    def __init__(self, fds: list[int], seed: int = 0) -> None:
        self.fds = fds
        self.links = [Link() for _ in fds]
        self.macs: dict[bytes, int] = {}  # learnt: source address -> port
        self.pending: list[tuple[float, int, int, bytes]] = []  # (due, seq, port, frame)
        self.seq = 0
        self.rng = random.Random(seed)
        self.forwarded = self.delayed = self.duplicated = self.dropped = 0  # delayed frames are forwarded later

    def control(self, line: str) -> str:
        try:
            spec = json.loads(line)
            if not isinstance(spec, dict):
                raise ValueError("expected a JSON object")
            if spec.get("stats"):
                return json.dumps({"forwarded": self.forwarded, "delayed": self.delayed,
                                   "duplicated": self.duplicated, "dropped": self.dropped})
            ports = spec.get("ports")
            ports = range(len(self.fds)) if ports is None else ports
            for p in ports:
                if not isinstance(p, int) or not 0 <= p < len(self.fds):
                    raise ValueError(f"port {p!r}: expected 0..{len(self.fds) - 1}")
            Link().set(spec)  # validated on a scratch link first: all ports or none
            for p in ports:
                self.links[p].set(spec)
        except (ValueError, TypeError) as e:
            return f"error: {e}"
        return "ok"

    def frame_in(self, port: int, frame: bytes, now: float) -> None:
        if len(frame) < 14:
            return
        self.macs[frame[6:12]] = port
        out = self.macs.get(frame[:6]) if frame[:6] != BROADCAST else None
        tx = self.links[port]
        for p in [out] if out is not None else range(len(self.fds)):
            if p == port:
                continue
            rx = self.links[p]
            if tx.idle and rx.idle:
                self.send(p, frame)
                continue
            copies = 1 + (self.rng.random() < tx.dup)  # a frame crosses its sender's cable, then its receiver's
            copies += sum(self.rng.random() < rx.dup for _ in range(copies))
            self.duplicated += copies - 1
            for _ in range(copies):
                due = now + tx.hold(self.rng) + rx.hold(self.rng)
                self.seq += 1
                heapq.heappush(self.pending, (due, self.seq, p, frame))
                self.delayed += 1

    def send(self, port: int, frame: bytes) -> None:
        try:
            os.write(self.fds[port], frame)
            self.forwarded += 1
        except OSError as e:  # the port's queue is full, or it is down: the frame is lost
            if e.errno not in (errno.EAGAIN, errno.EIO, errno.ENOBUFS, errno.EINVAL):
                raise
            self.dropped += 1

    def due(self, now: float) -> float | None:
        """Send every held frame now due; seconds until the next one (None: nothing held)."""
        while self.pending and self.pending[0][0] <= now:
            _, _, p, frame = heapq.heappop(self.pending)
            self.send(p, frame)
        return max(0.0, self.pending[0][0] - now) if self.pending else None


def serve(names: list[str]) -> int:
    fds = [open_tap(n) for n in names]
    sw = Switch(fds, seed=os.getpid())
    sel = selectors.DefaultSelector()
    for i, fd in enumerate(fds):
        sel.register(fd, selectors.EVENT_READ, i)
    stdin = sys.stdin.fileno()
    os.set_blocking(stdin, False)
    sel.register(stdin, selectors.EVENT_READ, -1)
    print("ready", flush=True)
    buf = b""
    timeout: float | None = None
    while True:
        for key, _ in sel.select(timeout):
            if key.data == -1:
                chunk = os.read(stdin, 65536)
                if not chunk:
                    return 0
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        print(sw.control(line.decode(errors="replace")), flush=True)
                continue
            now = time.monotonic()
            for _ in range(64):  # drain the port, bounded so that one busy port cannot starve the others
                try:
                    frame = os.read(key.fd, 65536)
                except BlockingIOError:
                    break
                except OSError:  # the device is gone (its namespace deleted): the port is dead
                    sel.unregister(key.fd)
                    break
                sw.frame_in(key.data, frame, now)
        timeout = sw.due(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    if not names:
        print("usage: python -m chaos.wire TAP0 TAP1 ...", file=sys.stderr)
        return 2
    try:
        return serve(names)
    except OSError as e:
        print(f"chaos.wire: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
