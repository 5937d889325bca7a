"""deploy/k8s as kustomize renders it, and the rest of deploy/ beside it: one image tag (the package version),
one shim socket path, a TLS Secret with every node's certificate (each node's init container passes with it),
genesis equal to the engine the example pod runs, and liveness apart from readiness."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.config import AgentConfig, from_dict
from agent.process import LIVENESS
from agent.security import SERVER_NAME, write_dev_certs
from dataplane_shim.plugin import Settings
from tests.conftest import engine_missing
from tests.deploy.deployfiles import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    IMAGE_REPO,
    K8S,
    ROOT,
    VERSION,
    by_kind,
    compose,
    compose_agents,
    containers,
    dockerfile_install,
    dockerfile_runs,
    kustomize,
    kustomize_binary,
    render,
    service_mounts,
    split_image,
)

SOCKET = "/var/lib/emoe/shim.sock"
EXAMPLE = K8S / "examples" / "vllm-pod.yaml"
TLS = K8S / "tls"
GUIDE = DEPLOY / "OPERATIONS.md"
ENGINE_CONFIGS = ["k8s.toml", "lan.toml"]  # the configs for nodes that run a real engine


def config(name: str) -> AgentConfig:
    return from_dict(tomllib.loads((DEPLOY / "configs" / name).read_text()))


def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    return by_kind(render(K8S))


def daemonset() -> dict[str, Any]:
    return rendered()[("DaemonSet", "emoe-agent")]


def example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    return doc


def engine_container() -> dict[str, Any]:
    (c,) = [c for c in example()["spec"]["containers"] if c["name"] == "vllm"]
    return c


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def tls_copy_with_certs(tmp: Path) -> Path:
    """deploy/k8s/tls with development certificates for the seeds of configs/k8s.toml in its certs/."""
    kdir = tmp / "tls"
    shutil.copytree(TLS, kdir, ignore=shutil.ignore_patterns("certs"))
    write_dev_certs(kdir / "certs", sorted(config("k8s.toml").seed_map), clients=["admin"])
    return kdir


# ---- the renderer is kustomize ------------------------------------------------------------------------

def _canon(docs: list[dict[str, Any]]) -> list[str]:
    for d in docs:  # kustomize prints a Secret's base64 over several lines: YAML reads them joined by spaces
        if d["kind"] == "Secret":
            d["data"] = {k: "".join(v.split()) for k, v in d["data"].items()}
    return sorted(json.dumps(d, sort_keys=True) for d in docs)


@pytest.mark.skipif(kustomize_binary() is None, reason="neither kustomize nor kubectl installed (`make kustomize`)")
def test_the_renderer_agrees_with_kustomize(tmp_path: Path) -> None:
    assert _canon(render(K8S)) == _canon(kustomize(K8S))
    kdir = tls_copy_with_certs(tmp_path)
    assert _canon(render(kdir)) == _canon(kustomize(kdir))


def test_the_example_is_not_applied_with_the_agents() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert EXAMPLE.is_file() and not any(r.startswith(("examples", "tls")) for r in k["resources"])
    assert ("Pod", "vllm-gpu-node-1") not in rendered()


# ---- one image tag -------------------------------------------------------------------------------------

def test_one_image_tag_the_package_version() -> None:
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert [i for i in k["images"] if i["name"] == IMAGE_REPO] == [{"name": IMAGE_REPO, "newTag": VERSION}]
    want = f"{IMAGE_REPO}:{VERSION}"
    ours = [c["image"] for d in render(K8S) for c in containers(d) if split_image(c["image"])[0] == IMAGE_REPO]
    assert ours and set(ours) == {want}, ours  # as rendered ...
    raw = [c["image"] for f in K8S.glob("*.yaml") for d in yaml.safe_load_all(f.read_text()) if d
           for c in containers(d) if split_image(c["image"])[0] == IMAGE_REPO]
    assert set(raw) == {want}  # ... and as `kubectl apply -f` would take the files
    assert {c["image"] for c in containers(example()) if split_image(c["image"])[0] == IMAGE_REPO} == {want}
    services = compose()["services"]
    assert {s["image"] for s in services.values() if split_image(s["image"])[0] == IMAGE_REPO} == {want}
    assert f"-t {want} ." in DOCKERFILE.read_text()
    make = subprocess.run(["make", "-n", "-s", "image"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert make.returncode == 0 and f"docker build -f deploy/docker/Dockerfile -t {want} ." in make.stdout, make


def test_the_image_installs_the_etcd_extra_the_compose_configs_need() -> None:
    install, _, src = dockerfile_install()
    assert f"{src}[etcd]" in install, install
    for s in compose_agents().values():
        cfg = s["command"][s["command"].index("--config") + 1]
        toml = (COMPOSE.parent / service_mounts(s)[cfg]).resolve()
        assert tomllib.loads(toml.read_text())["consensus"]["backend"] == "etcd"


# ---- one socket path -----------------------------------------------------------------------------------

def _socket_paths(text: str) -> set[str]:
    """Absolute paths of a shim socket (not `<data_dir>/shim.sock`, nor the tail of a longer path)."""
    return set(re.findall(r"(?<![\w>}/.])/[\w./-]*shim\.sock", text))


@pytest.mark.parametrize("name", ["k8s.toml", "lan.toml", "compose-node1.toml", "compose-node2.toml",
                                  "compose-node3.toml"])
def test_deploy_configs_serve_the_one_socket(name: str) -> None:
    assert config(name).shim_socket_path == SOCKET


@pytest.mark.parametrize("path", ["README.md", "docs/engines.md", "deploy/OPERATIONS.md", "deploy/k8s/daemonset.yaml",
                                  "deploy/k8s/configmap.yaml", "deploy/k8s/examples/vllm-pod.yaml",
                                  "deploy/configs/k8s.toml", "deploy/configs/lan.toml",
                                  "deploy/systemd/emoe.sysusers.conf"])
def test_every_document_names_the_one_socket(path: str) -> None:
    found = _socket_paths((ROOT / path).read_text())
    assert found == {SOCKET}, found


def test_agent_and_engine_share_the_socket_directory() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    vols = {v["name"]: v for v in spec["volumes"]}
    data = {m["mountPath"]: vols[m["name"]] for m in agent["volumeMounts"]}
    sock_dir = os.path.dirname(SOCKET)
    assert data[sock_dir]["hostPath"]["path"] == sock_dir  # the agent's socket dir is the host's
    pod = example()["spec"]
    evols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: evols[m["name"]] for m in engine_container()["volumeMounts"]}
    assert mounts[sock_dir]["hostPath"]["path"] == sock_dir  # and the engine's, at the same path
    assert env(engine_container())["EMOE_SOCKET"] == SOCKET
    # the socket is 0660 in the data dir's group, which the agent's init container sets to the agent's gid:
    # the engine runs in that group
    own = next(c for c in spec["initContainers"] if c["name"] == "own-data-dir")
    uid, gid = own["command"][1].split(":")
    assert agent["securityContext"]["runAsGroup"] == int(gid)
    assert int(gid) in pod["securityContext"]["supplementalGroups"]


# ---- the TLS Secret carries every node's certificate --------------------------------------------------

def test_the_secret_lists_every_node() -> None:
    k = yaml.safe_load((TLS / "kustomization.yaml").read_text())
    (gen,) = k["secretGenerator"]
    names = {Path(f).name for f in gen["files"]}
    nodes = sorted(config("k8s.toml").seed_map)
    assert names == {"ca.pem"} | {f"{n}.pem" for n in nodes} | {f"{n}-key.pem" for n in nodes}
    assert "ca-key.pem" not in names
    tls = next(v for v in daemonset()["spec"]["template"]["spec"]["volumes"] if v["name"] == "tls")
    assert tls["secret"]["secretName"] == gen["name"] and k["namespace"] == daemonset()["metadata"]["namespace"]


def test_every_nodes_init_container_passes_with_the_secret(tmp_path: Path) -> None:
    """The Secret as rendered, mounted as its volume is; then each node's render-config init container (its own
    shell line: node_id set to the node's name, then `emoe agent --check`), with the pod's paths under tmp."""
    (secret,) = [d for d in render(tls_copy_with_certs(tmp_path)) if d["kind"] == "Secret"]
    spec = daemonset()["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "render-config")
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    vol = tmp_path / "volume"
    vol.mkdir()
    import base64

    for key, b64 in secret["data"].items():
        (vol / key).write_bytes(base64.b64decode(b64))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    emoe = bin_dir / "emoe"
    emoe.write_text(f"#!/bin/sh\nexec {sys.executable} -m agent.cli \"$@\"\n")
    emoe.chmod(emoe.stat().st_mode | stat.S_IXUSR)
    shared = tmp_path / "shared"
    shared.mkdir()
    text = rendered()[("ConfigMap", "emoe-agent-config")]["data"]["agent.toml"]
    cfg = tomllib.loads(text)
    data = tmp_path / "data"
    text = text.replace(f'"{cfg["data_dir"]}"', f'"{data}"').replace(f'"{cfg["tls"]["cert_dir"]}"', f'"{vol}"')
    (shared / "agent.toml").write_text(text)
    script = init["command"][-1]
    for path, here in ((mounts["shared-config"], shared), (mounts["config"], tmp_path / "run")):
        script = script.replace(path, str(here))
    (tmp_path / "run").mkdir()
    for node in sorted(config("k8s.toml").seed_map):
        r = subprocess.run([*init["command"][:-1], script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NODE_NAME": node})
        assert r.returncode == 0 and f"ok (node {node}" in r.stdout, (node, r.stderr)


def test_the_guide_says_what_a_certificate_must_carry() -> None:
    text = GUIDE.read_text()
    assert f"dnsNames: [gpu-node-2, {SERVER_NAME}]" in text and f"`{SERVER_NAME}`" in text
    assert "kubectl apply -k deploy/k8s/tls" in text
    assert "--from-file=tls/gpu-node-1.pem" not in text  # the one-node Secret of before


# ---- genesis is the engine's boot placement -----------------------------------------------------------

def test_genesis_is_the_engine_the_example_runs() -> None:
    c = engine_container()
    engine = c["command"][0]
    assert engine == "vllm" and split_image(c["image"])[0].startswith("vllm/")
    settings = Settings.from_env(env(c))  # the plugin's own reading of its environment
    assert settings is not None and settings.socket == SOCKET and settings.genesis == engine
    for name in ENGINE_CONFIGS:
        assert config(name).cluster.genesis == engine, name
    # the engine's shape is the cluster's: EP ranks, ranks per node, physical slots
    cfg = config("k8s.toml")
    cl = cfg.cluster
    args = dict(a.removeprefix("--").split("=", 1) for a in c["args"] if a.startswith("--") and "=" in a)
    assert int(args["data-parallel-size"]) == cl.nodes * cl.ranks_per_node
    assert int(args["data-parallel-size-local"]) == cl.ranks_per_node
    redundant = json.loads(args["eplb-config"])["num_redundant_experts"]
    assert cl.experts + redundant == cl.nodes * cl.ranks_per_node * cl.slots_per_rank
    assert "--enable-eplb" in c["args"] and "--enable-expert-parallel" in c["args"]
    assert cfg.decision.window % settings.report_every == 0
    assert settings.sample_every == cfg.decision.sample_every


def test_the_plugin_comes_from_the_agent_images_wheel() -> None:
    (init,) = example()["spec"]["initContainers"]
    (wheels,) = re.findall(r"--wheel-dir\s+(\S+)", "\n".join(dockerfile_runs()))
    assert f"{wheels}/elasticmoe-*.whl" in init["command"][-1]
    (target,) = re.findall(r"--target\s+(\S+)", init["command"][-1])
    assert env(engine_container())["PYTHONPATH"] == target
    assert target in [m["mountPath"] for m in engine_container()["volumeMounts"]]


@pytest.mark.engine
def test_the_example_runs_under_vllms_own_parser() -> None:
    """The example's arguments are ones `vllm serve` accepts (vLLM from .venv-engine)."""
    engine_py = ROOT / ".venv-engine" / "bin" / "python"
    if not engine_py.exists():
        engine_missing(f"{engine_py} does not exist: `make .venv-engine/.installed` (part of `make test`) makes it")
    probe = ("import json, sys; from vllm.entrypoints.launchers.cli_args import make_arg_parser; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "ns = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1])); "
             "print(json.dumps([ns.model_tag, ns.data_parallel_size, ns.enable_eplb, "
             "ns.eplb_config.num_redundant_experts]))")
    r = subprocess.run([str(engine_py), "-c", probe, json.dumps(engine_container()["args"])], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["deepseek-ai/DeepSeek-V3", 32, True, 32]



# ---- liveness apart from readiness ---------------------------------------------------------------------

def test_liveness_and_readiness_are_separate() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    ready, live = agent["readinessProbe"]["grpc"], agent["livenessProbe"]["grpc"]
    assert ready.get("service", "") == ""  # the overall status: SERVING only when the agent serves
    assert live.get("service") == LIVENESS  # SERVING while the process runs
    health_port = int(config("k8s.toml").tls.health_listen.rsplit(":", 1)[1])
    assert ready["port"] == live["port"] == health_port
    # compose: the healthcheck is readiness (the overall status), which docker does not restart on
    agent_svc = next(iter(compose_agents().values()))
    check = agent_svc["healthcheck"]["test"]
    assert "HealthCheckRequest()" in check[-1] and "SERVING" in check[-1]
    assert agent_svc["restart"] == "on-failure"
