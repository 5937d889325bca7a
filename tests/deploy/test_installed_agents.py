"""The compose deployment as shipped, without Docker: the package's wheel, installed into a fresh virtual
environment with the Dockerfile's own install line (read from deploy/docker/Dockerfile), runs the three agents
of deploy/compose/docker-compose.yml (their `emoe` commands and environments, their configs with only host
names, ports and data dirs moved to loopback and temporary directories) against a real etcd started AFTER them:

- while etcd is absent each agent runs, logs its retries, is NOT_SERVING (gRPC health, the compose
  healthcheck, `emoe status`) and refuses proposals, while its `liveness` health service is SERVING;
- once etcd serves, every agent serves and a proposal (`emoe propose`, the fresh environment's CLI) commits;
- etcd killed mid-run: every agent is NOT_SERVING, still alive; etcd back: SERVING again, and a second
  proposal commits on every agent;
- etcd wiped (its data dir deleted while it is down): the agents write their history back, and the next proposal
  commits the next version on every agent.

The wheel and the environment are kept in .cache/deploy-test/<hash> for the next run, keyed by the hash of the
package's sources, pyproject.toml, README.md, the install line and this Python; only the newest is kept. The
install resolves the extras from the package index (or pip's cache), as `docker build` does; the one flag of the
line left out is --no-cache-dir (an image-size measure there; here the cache is what keeps a rerun quick)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent.process import LIVENESS
from chaos.etcdserver import EtcdProcess
from chaos.localcluster import stable_ports, write_config
from tests.deploy.deployfiles import (
    COMPOSE,
    ROOT,
    compose,
    compose_agents,
    dockerfile_install,
    service_argv,
    service_mounts,
)

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

CACHE = ROOT / ".cache" / "deploy-test"
LEFT_OUT = {"--no-cache-dir"}  # see the module docstring
INSTALL_TIMEOUT_S = 900  # a first install downloads grpcio, numpy, cryptography, ... from the index
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


# ---- the wheel and the environment --------------------------------------------------------------------

def _package_dirs() -> list[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted(p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"])


def _sources() -> list[Path]:
    """What the wheel is built from: pyproject.toml, README.md and the packages' files (no caches, no outputs)."""
    files = [ROOT / "pyproject.toml", ROOT / "README.md"]
    for d in _package_dirs():
        files += [p for p in sorted((ROOT / d).rglob("*")) if p.is_file() and "__pycache__" not in p.parts
                  and p.suffix != ".pyc" and not p.relative_to(ROOT).as_posix().startswith("bench/out/")]
    return files


def _key(install: list[str]) -> str:
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.relative_to(ROOT).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    h.update("\0".join([*install, sys.version]).encode())
    return h.hexdigest()[:16]


def _clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH (conftest points it at the checkout): the fresh environment runs its installed package."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR") or k.startswith("PIP_")}
    return {**keep, **extra}


def _install_line(install: list[str], venv_in_image: str, src_in_image: str, venv: Path, wheel: Path) -> list[str]:
    """The Dockerfile's line with the image's venv replaced by `venv` and its source tree by the wheel."""
    out = []
    for a in install:
        if a in LEFT_OUT:
            continue
        if a.startswith(venv_in_image + "/"):
            a = str(venv) + a[len(venv_in_image):]
        m = re.fullmatch(re.escape(src_in_image) + r"(\[[\w,-]+\])?", a)
        if m:
            a = str(wheel) + (m.group(1) or "")
        out.append(a)
    assert any(a.startswith(str(wheel)) for a in out), f"the install line names no {src_in_image}: {install}"
    return out


def _build(target: Path, install: list[str], venv_in_image: str, src_in_image: str) -> Path:
    tmp = target / "tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    src = tmp / "src"  # a copy: setuptools writes build/ and *.egg-info where it builds
    src.mkdir(parents=True)
    for p in _sources():
        dst = src / p.relative_to(ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, dst)
    wheels = target / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(src)],
                       capture_output=True, text=True, timeout=600, cwd=tmp, env=_clean_env())
    assert r.returncode == 0, f"pip wheel failed:\n{r.stderr[-3000:]}"
    (wheel,) = wheels.glob("elasticmoe-*.whl")
    venv = target / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300, env=_clean_env())
    line = _install_line(install, venv_in_image, src_in_image, venv, wheel)
    r = subprocess.run(line, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, cwd=tmp,
                       env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert r.returncode == 0, f"{' '.join(line)} failed:\n{r.stderr[-3000:]}"
    shutil.rmtree(tmp, ignore_errors=True)
    return venv


@pytest.fixture(scope="module")
def venv() -> Path:
    """The fresh environment with the wheel installed by the Dockerfile's line (reused while the key holds)."""
    install, venv_in_image, src_in_image = dockerfile_install()
    key = _key(install)
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as lock:  # one build at a time in this checkout
        fcntl.flock(lock, fcntl.LOCK_EX)
        target = CACHE / key
        if not (target / "done").exists():
            for old in CACHE.iterdir():  # bounded: only the newest environment is kept
                if old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)
            target.mkdir()
            _build(target, install, venv_in_image, src_in_image)
            (target / "done").write_text(" ".join(install) + "\n")
    venv = target / "venv"
    # the agents run the installed package (built from this checkout's sources: the key), not the checkout
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import aetcd, agent; print(agent.__file__)"],
                       capture_output=True, text=True, timeout=120, cwd=CACHE, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).is_relative_to(venv), r.stdout
    return venv


# ---- the compose agents on loopback ---------------------------------------------------------------------

class Agents:
    """The compose file's agent services as processes of the fresh environment, and its etcd (not started)."""

    def __init__(self, venv: Path, base: Path) -> None:
        self.venv, self.base = venv, base
        services = compose_agents()
        ports = stable_ports(len(services) + 2)  # below the ephemeral range: free while etcd is down
        etcd_cmd = compose()["services"]["etcd"]["command"]
        (client_url,) = [a.split("=", 1)[1] for a in etcd_cmd if a.startswith("--advertise-client-urls=")]
        etcd_host, etcd_port = client_url.removeprefix("http://").rsplit(":", 1)
        self.etcd = EtcdProcess(_which_etcd(), str(base / "etcd"), ports=(ports[-2], ports[-1]), start=False)
        # (compose host, container port) -> loopback address: the only things rewritten
        where: dict[tuple[str, int], str] = {(etcd_host, int(etcd_port)): self.etcd.endpoint}
        raws: dict[str, dict[str, Any]] = {}
        for (name, s), port in zip(services.items(), ports, strict=False):
            argv = service_argv(s)
            src = (COMPOSE.parent / service_mounts(s)[argv[argv.index("--config") + 1]]).resolve()
            raws[name] = tomllib.loads(src.read_text())
            where[(s["hostname"], int(raws[name]["listen"].rsplit(":", 1)[1]))] = f"127.0.0.1:{port}"

        def moved(hostport: str) -> str:
            host, port = hostport.rsplit(":", 1)
            return where[(host, int(port))]

        self.addresses: dict[str, str] = {}
        self.argv: dict[str, list[str]] = {}
        self.env: dict[str, dict[str, str]] = {}
        for name, s in services.items():
            raw = raws[name]
            argv = service_argv(s)
            mounts = service_mounts(s)
            assert raw["data_dir"] in mounts, f"{name}: its data_dir {raw['data_dir']} is no volume"
            listen = where[(s["hostname"], int(raw["listen"].rsplit(":", 1)[1]))]
            new = {**raw, "listen": listen, "data_dir": str(base / name / "data"),
                   "seeds": [f"{n}@{moved(a)}" for n, a in (x.split("@", 1) for x in raw["seeds"])],
                   "consensus": {**raw["consensus"], "etcd_endpoints": [moved(e) for e in
                                                                      raw["consensus"]["etcd_endpoints"]]}}
            changed = {k for k in new if new[k] != raw[k]}
            assert changed <= {"listen", "data_dir", "seeds", "consensus"}, changed
            assert {k for k in new["consensus"] if new["consensus"][k] != raw["consensus"][k]} <= {"etcd_endpoints"}
            (base / name).mkdir(parents=True)
            cfg = base / name / "agent.toml"
            write_config(cfg, {k: v for k, v in new.items() if not isinstance(v, dict)},
                         {k: v for k, v in new.items() if isinstance(v, dict)})
            i = argv.index("--config") + 1
            self.argv[name] = [str(venv / "bin" / argv[0]), *argv[1:i], str(cfg), *argv[i + 1:]]
            self.env[name] = _clean_env(PATH=f"{venv / 'bin'}:/usr/bin:/bin", PYTHONUNBUFFERED="1",
                                        HOME=str(base / name), **s.get("environment", {}))
            self.addresses[name] = listen
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self) -> None:
        for name, argv in self.argv.items():
            with open(self.log(name), "ab") as log:
                self.procs[name] = subprocess.Popen(argv, cwd=self.base / name, env=self.env[name], stdout=log,
                                                    stderr=subprocess.STDOUT, start_new_session=True)

    def log(self, name: str) -> Path:
        return self.base / name / "agent.log"

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.etcd.stop()

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def health(self, name: str, service: str = "") -> int | None:
        """The agent's gRPC health for `service` ("": readiness), None when it does not answer."""
        with grpc.insecure_channel(self.addresses[name]) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=2)
            except grpc.RpcError:
                return None
            return int(reply.status)

    def emoe(self, name: str, *args: str) -> subprocess.CompletedProcess[str]:
        """The fresh environment's CLI against agent `name`."""
        return subprocess.run([str(self.venv / "bin" / "emoe"), *args, "--agent", self.addresses[name]],
                              capture_output=True, text=True, timeout=60, cwd=self.base, env=_clean_env())

    def status(self, name: str) -> dict[str, Any]:
        r = self.emoe(name, "status", "--json")
        assert r.returncode == 0, r.stderr
        doc: dict[str, Any] = json.loads(r.stdout)
        return doc

    def healthcheck(self, name: str) -> int:
        """The compose healthcheck's command (CMD form) in this environment, against agent `name`: its exit."""
        check = compose()["services"][name]["healthcheck"]["test"]
        assert check[0] == "CMD" and check[1] == "python"
        port = int(tomllib.loads(Path(self.argv[name][-1]).read_text())["listen"].rsplit(":", 1)[1])
        code = check[3].replace("127.0.0.1:7400", f"127.0.0.1:{port}")  # the container's own port, moved
        r = subprocess.run([str(self.venv / "bin" / "python"), check[2], code], capture_output=True, text=True,
                           timeout=30, env=_clean_env())
        return r.returncode


def _which_etcd() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd binary not found (Debian: apt-get install etcd-server, or `make etcd`)")
    return binary


def until(what: str, ok: Callable[[], bool], agents: Agents, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert agents.alive(), f"an agent exited while waiting for {what}:\n{_tails(agents)}"
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}\n{_tails(agents)}")
        time.sleep(0.25)


def _tails(agents: Agents) -> str:
    return "\n".join(f"--- {n}:\n" + "\n".join(agents.log(n).read_text(errors="replace").splitlines()[-15:])
                     for n in agents.argv)


@pytest.fixture
def agents(venv: Path, tmp_path: Path) -> Iterator[Agents]:
    _which_etcd()
    a = Agents(venv, tmp_path)
    try:
        a.start()
        yield a
    finally:
        a.stop()


def _propose(agents: Agents, name: str, op: str) -> int:
    r = agents.emoe(name, "propose", op, "--force")
    assert r.returncode == 0, (r.stdout, r.stderr)
    m = re.search(r"ok: version (\d+)", r.stdout)
    assert m, r.stdout
    return int(m.group(1))


def test_compose_agents_wait_for_etcd_and_survive_its_restart(agents: Agents) -> None:
    names = list(agents.argv)
    assert len(names) == 3

    # etcd absent: alive, not ready, saying why; the compose healthcheck and `emoe status` agree
    until("every agent answers, NOT_SERVING", lambda: all(agents.health(n) == NOT_SERVING for n in names), agents)
    assert all(agents.health(n, LIVENESS) == SERVING for n in names)
    until("a retry logged", lambda: "retrying in" in agents.log(names[0]).read_text(), agents)
    assert agents.healthcheck(names[0]) != 0
    st = agents.status(names[0])
    assert st["health"].startswith("NOT_SERVING") and agents.etcd.endpoint in st["health"], st["health"]
    refused = agents.emoe(names[0], "propose", "swap 0 0 0 10 1", "--force")
    assert refused.returncode != 0 and "NOT_SERVING" in refused.stderr, refused

    # etcd starts: every agent serves, a proposal commits everywhere
    agents.etcd.start()
    agents.etcd.wait_ready()
    until("every agent SERVING", lambda: all(agents.health(n) == SERVING for n in names), agents)
    assert agents.healthcheck(names[0]) == 0 and agents.status(names[1])["health"] == "SERVING"
    v = _propose(agents, names[0], "swap 0 0 0 10 1")
    until(f"version {v} on every agent",
          lambda: all(int(agents.status(n)["committed_version"]) == v for n in names), agents)

    # etcd killed mid-run: not ready, alive; back: ready, and the next proposal commits
    agents.etcd.stop()
    until("every agent NOT_SERVING", lambda: all(agents.health(n) == NOT_SERVING for n in names), agents)
    assert all(agents.health(n, LIVENESS) == SERVING for n in names) and agents.alive()
    assert "etcd" in agents.status(names[2])["health"]
    agents.etcd.start()
    agents.etcd.wait_ready()
    until("every agent SERVING again", lambda: all(agents.health(n) == SERVING for n in names), agents)
    v2 = _propose(agents, names[1], "swap 1 0 0 10 1")
    assert v2 == v + 1
    until(f"version {v2} on every agent",
          lambda: all(int(agents.status(n)["committed_version"]) == v2 for n in names), agents)

    # etcd wiped (its data dir lost): the agents write the history back from their data_dirs, and the next
    # proposal is the next version, not a second table for version 2 on etcd's empty history
    agents.etcd.stop()
    until("every agent NOT_SERVING", lambda: all(agents.health(n) == NOT_SERVING for n in names), agents)
    shutil.rmtree(agents.etcd.argv[agents.etcd.argv.index("--data-dir") + 1])
    agents.etcd.start()
    agents.etcd.wait_ready()
    until("every agent SERVING on the wiped etcd", lambda: all(agents.health(n) == SERVING for n in names), agents)
    assert all(int(agents.status(n)["committed_version"]) == v2 for n in names)
    v3 = _propose(agents, names[2], "swap 0 10 0 0 1")  # the first swap, undone
    assert v3 == v2 + 1
    until(f"version {v3} on every agent",
          lambda: all(int(agents.status(n)["committed_version"]) == v3 for n in names), agents)
    wrote_back = [n for n in names if f"below version {v2} that this node committed" in agents.log(n).read_text()]
    assert wrote_back, "no agent said it wrote the history back"

    for n in names:  # IO failures are logged as one line each, never as a traceback
        text = agents.log(n).read_text(errors="replace")
        assert "Traceback" not in text and "never retrieved" not in text, f"{n}:\n{text[-3000:]}"
        assert re.search(r"WARNING no etcd endpoint reachable \(127\.0\.0\.1:\d+: .*\); retrying in [\d.]+ s",
                         text), text[-2000:]


def test_the_installed_wheel_runs_the_demo_outside_the_checkout(venv: Path, tmp_path: Path) -> None:
    """`emoe demo` from the fresh environment, in a directory away from the checkout, with nothing of the
    checkout on the path: real agent processes commit on the trace bundled in the wheel."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(venv / "bin" / "emoe"), "demo", "--segment-steps", "300", "--window", "50",
                        "--step-ms", "2", "--json", "--out", str(tmp_path / "out")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["trace"] == "esft:intent -> esft:law" and report["versions_committed"] >= 1
    assert report["imbalance_after"] < report["imbalance_before"]
