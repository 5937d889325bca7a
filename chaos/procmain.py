"""Entry points of the real-process chaos runner: `python -m chaos run --runner processes` (chaos/__main__.py's
hook calls `main`) and `run_processes` for tests; the runner itself is chaos/procrunner.py."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from chaos.procrunner import ProcRunner


async def _until_terminated(run: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """`run`, cancelled by SIGTERM as by Ctrl-C, so that its cleanup (agents, namespaces, tmpfs mounts) runs."""
    task = asyncio.ensure_future(run)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    finally:
        loop.remove_signal_handler(signal.SIGTERM)



def run_processes(nodes: int, schedules: int, seed: int, out: Path | None = None, progress: bool = False,
                  netns: bool = True, disks: bool = False) -> dict[str, Any]:
    """Run `schedules` fault schedules against `nodes` agent processes; the JSON report as a dict (also
    written to out/report.json when `out` is given)."""
    import json

    if nodes < 3:
        raise ValueError(f"--nodes {nodes}: expected >= 3 (a quorum must survive one fault)")
    say = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else None
    with tempfile.TemporaryDirectory(prefix="emoe-chaos-") as tmp:
        runner = ProcRunner(nodes, Path(tmp), seed, log=say, netns=netns, disks=disks)
        result = asyncio.run(_until_terminated(runner.run(schedules)))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(a: argparse.Namespace) -> int:
    """`python -m chaos run --runner processes ...` (chaos/__main__.py's hook): print the report (one JSON
    line with --json, progress on stderr otherwise); exit status 1 if an invariant was violated."""
    import json

    try:
        res = run_processes(a.nodes, a.schedules, a.seed, Path(a.out) if a.out else None,
                            progress=not a.json or bool(getattr(a, "progress", 0)),
                            netns=not getattr(a, "no_netns", False), disks=bool(getattr(a, "disks", False)))
    except (ValueError, RuntimeError) as e:
        print(f"chaos run --runner processes: {e}", file=sys.stderr)
        return 2
    except (asyncio.CancelledError, KeyboardInterrupt):
        print("chaos run --runner processes: interrupted; agents stopped, namespaces and mounts removed",
              file=sys.stderr)
        return 130
    print(json.dumps(res) if a.json else json.dumps(res, indent=2))
    return 1 if any(res["violations"].values()) else 0
