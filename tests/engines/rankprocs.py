"""Engine harnesses as process groups: no rank process outlives its harness.

A harness (tests/engine_harness/*) spawns rank processes (`torch.multiprocessing.spawn`, vLLM's engine core);
killing the harness's own process, as `subprocess.run` does on a timeout, leaves them running (re-parented,
still holding ports, CPU and the pipes). So every harness starts in a session of its own (`start`: its process
group is its pid), and ends with its whole group: on a timeout (`finish` kills the group, then raises
`HarnessTimeout`), and whenever a test is done with it (`stop`), however the test ended. `alive` says which
of a group's processes are still running (zombies are not), read from /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

GONE_S = 10.0  # after SIGKILL, how long a group's processes may take to be gone (the kernel's reaping)


class HarnessTimeout(AssertionError):
    """A harness ran past its timeout; its whole process group was killed. `output`: the tail it printed."""

    def __init__(self, args: Sequence[str], timeout: float, output: str) -> None:
        super().__init__(f"{Path(args[1]).name if len(args) > 1 else args[0]} ran past {timeout} s: its process "
                         f"group was killed; output tail:\n{output[-3000:]}")
        self.output = output


def start(args: Sequence[str], *, stdout: int | IO[Any] | None = None, stderr: int | IO[Any] | None = None,
          cwd: Path | str | None = None, env: dict[str, str] | None = None, text: bool = False) -> subprocess.Popen[Any]:
    """The harness in a session of its own: its process group id is its pid, inherited by every rank."""
    return subprocess.Popen(list(args), stdout=stdout, stderr=stderr, cwd=cwd, env=env, text=text,
                            start_new_session=True)


def run(args: Sequence[str], *, timeout: float, cwd: Path | str | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(args, capture_output=True, text=True, timeout=timeout)`, but a timeout kills the
    harness's whole process group (`HarnessTimeout`)."""
    proc = start(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env, text=True)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


def finish(proc: subprocess.Popen[Any], timeout: float) -> tuple[Any, Any]:
    """Wait up to `timeout` seconds for the harness to exit and take what it printed; past it, kill its group
    and raise `HarnessTimeout`. Either way, no process of its group runs afterwards."""
    try:
        got = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc)
        try:
            out, err = proc.communicate(timeout=GONE_S)
        except subprocess.TimeoutExpired:  # a process outside the group holds its pipes: the tail is lost
            out, err = "", ""
        text = "".join(x if isinstance(x, str) else x.decode(errors="replace") for x in (out, err) if x)
        raise HarnessTimeout([str(a) for a in proc.args], timeout, text) from None  # type: ignore[union-attr]
    stop(proc)  # it exited: a rank it left behind goes too
    return got


def stop(proc: subprocess.Popen[Any]) -> None:
    """Kill the harness's process group (its ranks, whether or not the harness itself already exited), reap
    the harness, and wait until none of the group runs; AssertionError naming the survivors otherwise."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is empty: every process of it already exited
        pass
    proc.wait()
    deadline = time.monotonic() + GONE_S
    while (left := alive(group(proc.pid))) and time.monotonic() < deadline:
        time.sleep(0.05)
    if left:
        raise AssertionError(f"processes {left} of harness group {proc.pid} still run {GONE_S} s after SIGKILL")


def group(pgid: int) -> list[int]:
    """The pids of the processes in process group `pgid` (from /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            fields = _stat(int(d.name))
            if fields is not None and int(fields[2]) == pgid:
                pids.append(int(d.name))
    return pids


def alive(pids: Sequence[int]) -> list[int]:
    """Those of `pids` that are running processes (neither gone nor zombies)."""
    return [p for p in pids if (fields := _stat(p)) is not None and fields[0] not in ("Z", "X")]


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, ...; None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return raw[raw.rindex(")") + 2:].split()
