"""How soon an agent knows that one of its engine ranks' processes left: kill -9 a real shim process holding
its local link open (agent.link.ranklink), and time the kill to the agent's lost-rank callback.

    python -m bench.rankexit [--kills 20] [--json]

`detect_ms` (the median) is the link's close, seen by the agent's gRPC server, plus RankPresence's grace
(a shim that reconnects within it is not a loss). `emoe bench --kill-rank` takes it as the detection delay
of a rank whose process died while its node's agent lives; a whole node's death is found by membership
(`python -m bench.detect`), seconds later.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.clock import RealClock
from agent.link.ranklink import GRACE_S, RankPresence
from agent.link.shim_link import serve_unix

ROOT = Path(__file__).resolve().parents[1]
SHIM = """
import asyncio, sys
from dataplane_shim.link import ShimLink

async def main():
    async for _ in ShimLink(sys.argv[1], shim_id="bench", ranks=[0]).watch_tables(1):
        pass

asyncio.run(main())
"""


class _Idle:
    def head_version(self) -> int:
        return 1

    def commits_since(self, version: int) -> list[object]:
        return []

    async def wait_for_newer(self, version: int) -> None:
        await asyncio.sleep(3600)


async def _attached(presence: RankPresence) -> None:
    while presence.open[0] < 1:
        await asyncio.sleep(0.01)


async def measure(kills: int) -> list[float]:
    out: list[float] = []
    with tempfile.TemporaryDirectory(prefix="emoe-") as d:
        sock = os.path.join(d, "shim.sock")
        lost: asyncio.Queue[float] = asyncio.Queue()
        presence = RankPresence(RealClock(), [0], lambda r: lost.put_nowait(time.monotonic()), lambda r: None)
        server = await serve_unix(sock, _Idle(), lambda r: None, presence=presence)  # type: ignore[arg-type]
        try:
            for i in range(kills):
                p = subprocess.Popen([sys.executable, "-c", SHIM, sock], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
                await asyncio.wait_for(_attached(presence), 30)
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                p.send_signal(signal.SIGKILL)
                t1 = await asyncio.wait_for(lost.get(), 30)
                await asyncio.to_thread(p.wait)
                out.append((t1 - t0) * 1e3)
                print(f"kill {i + 1}/{kills}: lost after {out[-1]:.1f} ms", file=sys.stderr)
        finally:
            presence.close()
            await server.stop(None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rankexit", description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.kills < 1:
        ap.error(f"--kills {a.kills}: expected >= 1")
    ms = asyncio.run(measure(a.kills))
    res = {"kills": a.kills, "grace_ms": GRACE_S * 1e3, "detect_ms": round(float(np.median(ms)), 1),
           "detect_p99_ms": round(float(np.percentile(ms, 99)), 1), "close_ms": round(float(np.median(ms)) - GRACE_S * 1e3, 1)}
    print(json.dumps(res) if a.json else " ".join(f"{k}={v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
