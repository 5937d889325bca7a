"""The switch between the process runner's namespaces (chaos/wire.py): what it does to frames, on pipes, and
what the agents' kernels see through it, on real TAP devices in real namespaces (root only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from chaos.wire import Switch

A, B, C = (bytes([2, 0, 0, 0, 0, k]) for k in (1, 2, 3))


def _frame(src: bytes, dst: bytes, n: int) -> bytes:
    return dst + src + b"\x08\x00" + n.to_bytes(4, "big") + bytes(46)


def _ports(n: int) -> tuple[Switch, list[int]]:
    """A switch whose ports are pipes: it writes into `w`, the test reads from the returned read ends."""
    rs, ws = zip(*(os.pipe() for _ in range(n)), strict=True)
    for w in ws:
        os.set_blocking(w, False)
    return Switch(list(ws), seed=3), list(rs)


def _read(fd: int) -> list[int]:
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    size = len(_frame(A, B, 0))
    return [int.from_bytes(data[i + 14:i + 18], "big") for i in range(0, len(data), size)]


def test_the_switch_learns_floods_delays_reorders_and_duplicates() -> None:
    sw, rs = _ports(3)
    sw.frame_in(0, _frame(A, b"\xff" * 6, 1), now=0.0)  # broadcast: every other port
    assert _read(rs[0]) == [] and _read(rs[1]) == [1] and _read(rs[2]) == [1]
    sw.frame_in(1, _frame(B, A, 2), now=0.0)  # A was learnt on port 0: only there
    assert _read(rs[0]) == [2] and _read(rs[2]) == []
    assert sw.control(json.dumps({"ports": [0], "delay_ms": 100, "jitter_ms": 100, "dup": 0.5})) == "ok"
    for n in range(40):
        sw.frame_in(1, _frame(B, A, 100 + n), now=n * 0.001)
    assert sw.due(0.099) is not None and _read(rs[0]) == []  # nothing before the delay
    assert sw.due(1.0) is None
    got = _read(rs[0])
    assert sorted(set(got)) == list(range(100, 140))  # every frame arrives ...
    assert got != sorted(got)  # ... some overtaken (jitter 100 ms over 1 ms spacing)
    assert len(got) - 40 == sw.duplicated > 0  # ... some twice
    rs_b = _read(rs[1])
    sw.frame_in(0, _frame(A, B, 8), now=2.0)  # port 0's cable holds frames it sends too
    assert _read(rs[1]) == rs_b == [] and sw.due(2.05) is not None and _read(rs[1]) == []
    sw.due(2.5)
    assert 8 in _read(rs[1])
    assert sw.control(json.dumps({"ports": None, "delay_ms": 0})) == "ok"
    sw.frame_in(1, _frame(B, A, 7), now=2.0)
    assert _read(rs[0]) == [7]  # lifted: at once


@pytest.mark.parametrize("spec, word", [
    ({"ports": [3]}, "port 3"), ({"delay_ms": -1}, "delay_ms -1"), ({"dup": 2}, "dup 2"),
    ({"jitter_ms": "x"}, "x"), ([1], "JSON object"),
])
def test_a_bad_control_line_is_refused_naming_the_field_and_changes_nothing(spec: object, word: str) -> None:
    sw, _ = _ports(3)
    said = sw.control(json.dumps(spec))
    assert said.startswith("error:") and word in said, said
    assert all(lk.idle for lk in sw.links)


def test_agents_kernels_see_the_delay_and_the_duplicates_through_real_namespaces() -> None:
    from chaos.netns import NetLab, unavailable

    why = unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable here: {why}")
    lab = NetLab(2).up()
    server = None
    try:
        server = subprocess.Popen(lab.wrap(1) + [sys.executable, "-c", (
            "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{lab.addr(1)}', 7777)); s.listen(64)\n"
            "while True:\n    c, _ = s.accept(); c.sendall(c.recv(16)); c.close()\n")])

        def connect_ms() -> float:
            r = subprocess.run(lab.wrap(0) + [sys.executable, "-c", (
                "import socket, time\nfor _ in range(50):\n    try:\n"
                f"        s = socket.create_connection(('{lab.addr(1)}', 7777), timeout=5); break\n"
                "    except ConnectionRefusedError:\n        time.sleep(0.1)\n"
                f"t = time.monotonic(); s = socket.create_connection(('{lab.addr(1)}', 7777), timeout=5)\n"
                "s.sendall(b'x'); assert s.recv(16) == b'x'\nprint((time.monotonic() - t) * 1000)\n")],
                capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
            return float(r.stdout)

        assert connect_ms() < 50
        lab.delay(100.0, nodes=[1])  # node 1's cable, both ways: a connect and one echo are two round trips
        assert 390 <= connect_ms() < 700
        lab.delay(100.0)  # every cable: a frame between two nodes is held twice
        assert connect_ms() >= 790
        lab.delay(dup=1.0)
        connect_ms()
        assert lab.stats()["duplicated"] > 0
        lab.heal()
        assert connect_ms() < 50
    finally:
        if server is not None:
            server.kill()
            server.wait(10)
        lab.close()
    names = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert lab.root_if not in names  # the switch took the runner's TAP with it
