"""Commit latency of the two backends, with real processes on loopback and real gRPC.

    python -m bench.commit --agents 8 --json

For each backend (quorum: ConsensusNode over GrpcTransport, every agent a voter; etcd: EtcdBackend against
one local etcd server) it starts `--agents` processes of `python -m bench.consensus_serve`, lets each
propose the versions whose round-0 owner it is (a rotation, so proposers change every version), and
reports percentiles of the time from a proposal to its commit being known at its proposer. The first
`--warmup` versions (channel set-up) are left out. Prints
`{"agents": N, "backends": {"quorum": {"p50_ms": .., "p99_ms": ..}, "etcd": {...}}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos.localcluster import free_ports

ROOT = Path(__file__).resolve().parent.parent


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * (len(s) - 1)))))
    return s[k]


def _readline(pr: subprocess.Popen[str], deadline: float) -> str:
    """One line of the agent's stdout, or "" once `deadline` passes."""
    assert pr.stdout is not None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return ""
        ready, _, _ = select.select([pr.stdout], [], [], min(left, 1.0))
        if ready:
            return pr.stdout.readline()


def _tail(workdir: Path, backend: str, node: str, chars: int = 2000) -> str:
    p = workdir / f"{backend}-{node}.stderr"
    return p.read_text()[-chars:] if p.exists() else ""


def _post_mortem(procs: list[subprocess.Popen[str]], ids: list[str], workdir: Path, backend: str) -> str:
    """Every agent: alive or its exit status, and its stderr tail after a dump of its threads' stacks
    (SIGUSR1: bench.consensus_serve registers faulthandler on it), so that a stall says where it is."""
    for pr in procs:
        if pr.poll() is None:
            pr.send_signal(signal.SIGUSR1)
    time.sleep(0.5)
    return "\n".join(f"--- {n}: {'alive' if pr.poll() is None else f'exited with {pr.returncode}'}\n"
                     f"{_tail(workdir, backend, n, 6000)}" for n, pr in zip(ids, procs, strict=True))


def run_backend(backend: str, agents: int, versions: int, workdir: Path, etcd: str, timeout: float,
                interval_ms: float = 20.0) -> dict[str, Any]:
    ports = free_ports(agents)
    ids = [f"a{i}" for i in range(agents)]
    peers = ",".join(f"{n}@127.0.0.1:{p}" for n, p in zip(ids, ports, strict=True))
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cluster = f"bench{int(time.time() * 1000)}"  # one fresh etcd key prefix per run
    try:
        for n, p in zip(ids, ports, strict=True):
            cmd = [sys.executable, *(os.environ["EMOE_BENCH_SERVE"].split() if os.environ.get("EMOE_BENCH_SERVE") else ["-m", "bench.consensus_serve"]), "--node-id", n, "--listen", f"127.0.0.1:{p}",
                   "--peers", peers, "--data-dir", str(workdir / backend / n), "--backend", backend,
                   "--bench-versions", str(versions), "--cluster", cluster, "--interval-ms", str(interval_ms)]
            if backend == "etcd":
                cmd += ["--etcd", etcd]
            errf = (workdir / f"{backend}-{n}.stderr").open("w")
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=errf, text=True))
            errf.close()
        deadline = time.monotonic() + timeout
        for n, pr in zip(ids, procs, strict=True):
            line = _readline(pr, deadline).strip()
            if line != "ready":
                raise RuntimeError(f"{backend} agent {n} did not start: {line!r} {_tail(workdir, backend, n)}")
        time.sleep(0.3)  # every server is listening before anyone proposes
        for pr in procs:
            assert pr.stdin is not None
            pr.stdin.write("go\n")
            pr.stdin.flush()
        results = []
        for n, pr in zip(ids, procs, strict=True):
            line = _readline(pr, deadline)
            if not line:
                raise RuntimeError(f"{backend} agent {n} gave no result:\n" + _post_mortem(procs, ids, workdir, backend))
            results.append(json.loads(line))
    finally:
        for pr in procs:
            if pr.poll() is None:
                pr.terminate()
        for pr in procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait(timeout=10)
            for f in (pr.stdin, pr.stdout, pr.stderr):
                if f is not None:
                    f.close()
    return {"results": results}


def summarize(results: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    # each agent's first proposals pay for channel set-up: drop the first `warmup` versions overall
    per_agent_skip = max(1, warmup // max(1, len(results)))
    lat: list[float] = []
    for r in results:
        lat += r["latencies_ms"][per_agent_skip:]
    return {"p50_ms": round(percentile(lat, 50), 3), "p99_ms": round(percentile(lat, 99), 3), "samples": len(lat),
            "failures": sum(len(r["failures"]) for r in results)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.commit", description=__doc__.split("\n")[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--versions", type=int, default=400, help="versions committed per backend")
    ap.add_argument("--warmup", type=int, default=16, help="first versions left out (channel set-up)")
    ap.add_argument("--backends", default="quorum,etcd")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--interval-ms", type=float, default=20.0,
                    help="idle time between a commit and the next proposal (plans come once per window, seconds "
                         "apart): each commit is measured on a quiet cluster; this is not a throughput test")
    ap.add_argument("--data-dir", default="", help="where the agents' stores (and etcd's) live; default: the "
                    "system temp dir. Put it on tmpfs (/dev/shm) to see the cost without the disk's fsync")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.agents < 1 or a.versions < 1:
        ap.error(f"--agents {a.agents} --versions {a.versions}: expected both >= 1")
    out: dict[str, Any] = {"agents": a.agents, "backends": {}}
    with tempfile.TemporaryDirectory(prefix="emoe-bench-commit-", dir=a.data_dir or None) as tmp:
        work = Path(tmp)
        etcd_proc = None
        try:
            for backend in a.backends.split(","):
                endpoint = ""
                if backend == "etcd":
                    binary = shutil.which("etcd")
                    if binary is None:
                        out["backends"]["etcd"] = {"p50_ms": None, "p99_ms": None, "skipped": "etcd binary not found"}
                        continue
                    from chaos.etcdserver import EtcdProcess

                    etcd_proc = EtcdProcess(binary, str(work / "etcd"))
                    etcd_proc.wait_ready()
                    endpoint = etcd_proc.endpoint
                res = run_backend(backend, a.agents, a.versions, work, endpoint, a.timeout, a.interval_ms)
                out["backends"][backend] = summarize(res["results"], a.warmup)
        finally:
            if etcd_proc is not None:
                etcd_proc.stop()
    if a.json:
        print(json.dumps(out))
    else:
        for b, r in out["backends"].items():
            print(f"{b}: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms ({r.get('samples', 0)} commits)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
