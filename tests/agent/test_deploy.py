"""deploy/: every config validates, every manifest parses, and every `emoe` command line that the unit,
the manifests and the operations guide name uses real subcommands and flags of `agent.cli.build_parser()`."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_config import on_this_host

from agent.cli import build_parser, main
from agent.config import from_dict, is_loopback

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
TOMLS = sorted(DEPLOY.rglob("*.toml"))
YAMLS = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
UNIT = DEPLOY / "systemd" / "emoe-agent.service"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
K8S = DEPLOY / "k8s"
GUIDE = DEPLOY / "OPERATIONS.md"
SHELLS = {"sh", "bash", "/bin/sh", "/bin/bash"}


# ---- extracting `emoe ...` command lines ------------------------------------------------------------

def _is_emoe(tok: str) -> bool:
    return tok.rsplit("/", 1)[-1] == "emoe"


def _is_op(tok: str) -> bool:
    return bool(tok) and all(c in "();<>|&" for c in tok)


def emoe_commands_in_shell(text: str) -> list[list[str]]:
    """The argv (after `emoe`) of every `emoe` invocation in a shell command line."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    toks = list(lex)
    out: list[list[str]] = []
    for i, t in enumerate(toks):
        prev = toks[i - 1] if i else ";"
        at_command = _is_op(prev) or prev in ("exec", "--", "sudo", "time", "do", "then", "else") or re.fullmatch(r"\w+=\S*", prev)
        if _is_emoe(t) and at_command:
            argv: list[str] = []
            for a in toks[i + 1:]:
                if _is_op(a):
                    break
                argv.append(a)
            out.append(argv)
    return out


def emoe_commands_in_argv(argv: list[str]) -> list[list[str]]:
    if not argv:
        return []
    if _is_emoe(argv[0]):
        return [argv[1:]]
    if argv[0] in SHELLS and "-c" in argv:
        return emoe_commands_in_shell(argv[argv.index("-c") + 1])
    return []


def unit_commands() -> list[list[str]]:
    out = []
    for line in UNIT.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip().startswith("Exec"):
            out += emoe_commands_in_shell(value.lstrip("-@+!:"))
    return out


def _k8s_docs() -> list[dict[str, Any]]:
    return [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _daemonset() -> dict[str, Any]:
    (ds,) = [d for d in _k8s_docs() if d["kind"] == "DaemonSet"]
    return ds


def _k8s_containers() -> list[dict[str, Any]]:
    spec = _daemonset()["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def k8s_commands() -> list[list[str]]:
    return [c for ctr in _k8s_containers() for c in emoe_commands_in_argv([*ctr.get("command", []),
                                                                             *ctr.get("args", [])])]


def _argv(v: Any) -> list[str]:
    return shlex.split(v) if isinstance(v, str) else list(v or [])


def compose_commands() -> list[list[str]]:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return [c for s in services.values()
            for c in emoe_commands_in_argv([*_argv(s.get("entrypoint")), *_argv(s.get("command"))])]


def guide_commands() -> list[list[str]]:
    """Commands in the guide's code blocks (complete command lines)."""
    blocks = [b for lang, b in re.findall(r"```(\w*)\n(.*?)```", GUIDE.read_text(), flags=re.S)
              if lang in ("", "sh", "bash", "console")]  # a yaml block is no shell
    return [c for b in blocks for line in b.splitlines() if line.strip()
            for c in emoe_commands_in_shell(line.split(" #", 1)[0])]


def guide_inline_commands() -> list[list[str]]:
    """Commands in the guide's inline code (`emoe pause`): may leave out required flags."""
    text = re.sub(r"```.*?```", "", GUIDE.read_text(), flags=re.S)
    spans = [m.replace("\n", " ") for m in re.findall(r"`([^`]+)`", text)]
    return [c for span in spans if re.search(r"(^|/)emoe ", span) for c in emoe_commands_in_shell(span)]


# ---- checking one against the parser ----------------------------------------------------------------

def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def check_command(argv: list[str], complete: bool = True) -> None:
    """Raises AssertionError naming the first unknown subcommand or flag, or a missing required flag."""
    parser, path, rest = build_parser(), ["emoe"], list(argv)
    while (subs := _subparsers(parser)) and rest and not rest[0].startswith("-"):
        assert rest[0] in subs, f"`{' '.join(path)} {rest[0]}`: no such subcommand (have {sorted(subs)})"
        parser = subs[rest[0]]
        path.append(rest.pop(0))
    assert not (complete and _subparsers(parser)), f"`{' '.join(path)}` needs a subcommand"
    options = {s: a for a in parser._actions for s in a.option_strings}
    given = set()
    i = 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("-") and tok != "-":
            flag = tok.split("=", 1)[0]
            assert flag in options, f"`{' '.join(path)}`: no flag {flag} (have {sorted(options)})"
            given.add(options[flag].dest)
            if "=" not in tok and options[flag].nargs != 0:
                i += 1  # its value
        i += 1
    for a in parser._actions if complete else ():
        if a.required and a.option_strings:
            assert a.dest in given, f"`{' '.join(path)}`: missing required {a.option_strings[0]}"


# ---- tests ------------------------------------------------------------------------------------------

def test_deploy_has_the_expected_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in [*TOMLS, *YAMLS]}
    for want in ("configs/lan.toml", "configs/local-node1.toml", "configs/k8s.toml", "configs/compose-node1.toml",
                 "k8s/daemonset.yaml", "k8s/service.yaml", "k8s/configmap.yaml", "compose/docker-compose.yml"):
        assert want in names
    assert UNIT.is_file() and GUIDE.is_file()


@pytest.mark.parametrize("path", TOMLS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_config_passes_check(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # --check also tries the data_dir and reads the TLS files: give it a host that has them
    assert main(["agent", "--config", str(on_this_host(path, tmp_path)), "--check"]) == 0, capsys.readouterr().err


def test_check_through_the_module_entry_point(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "agent", "--config",
                        str(on_this_host(DEPLOY / "configs/k8s.toml", tmp_path)), "--check"],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and ": ok (node gpu-node-1" in r.stdout, r.stderr


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs and all(isinstance(d, dict) for d in docs)


def test_checker_catches_renamed_flags_and_subcommands() -> None:
    check_command(["agent", "--config", "x.toml", "--check"])
    with pytest.raises(AssertionError, match="no flag --cfg"):
        check_command(["agent", "--cfg", "x.toml"])
    with pytest.raises(AssertionError, match="no such subcommand"):
        check_command(["agents", "--config", "x.toml"])
    with pytest.raises(AssertionError, match="missing required --config"):
        check_command(["agent", "--check"])
    assert emoe_commands_in_shell('sed "s/a/b/" f > g && exec /opt/x/emoe agent --config g; echo') == [
        ["agent", "--config", "g"]]
    assert emoe_commands_in_shell("python3 -m venv /opt/emoe && X=1 emoe status --json") == [["status", "--json"]]


@pytest.mark.parametrize("source", ["unit", "k8s", "compose", "guide"])
def test_named_commands_are_real(source: str) -> None:
    cmds = {"unit": unit_commands, "k8s": k8s_commands, "compose": compose_commands, "guide": guide_commands}[source]()
    assert cmds, f"no emoe command found in the {source}"
    for argv in cmds:
        check_command(argv)


def test_guide_inline_commands_are_real() -> None:
    cmds = guide_inline_commands()
    assert ["demo"] in cmds and ["pause"] in cmds
    for argv in cmds:
        check_command(argv, complete=False)


def test_unit_is_hardened() -> None:
    keys: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        k, sep, v = line.partition("=")
        if sep and not line.startswith("#"):
            keys.setdefault(k.strip(), []).append(v.strip())
    assert keys.get("User") == ["emoe"] or keys.get("DynamicUser") == ["yes"]
    for k, v in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                 "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX", "Restart": "on-failure",
                 "KillSignal": "SIGTERM"}.items():
        assert keys.get(k) == [v], k
    assert "/var/lib/emoe" in keys["ReadWritePaths"] and keys["TimeoutStopSec"]
    # the config it runs is under the ConfigurationDirectory, and the data dir the configs use is writable
    assert all(argv[argv.index("--config") + 1].startswith("/etc/emoe/") for argv in unit_commands())
    assert from_dict(__import__("tomllib").loads((DEPLOY / "configs/lan.toml").read_text())).data_dir == "/var/lib/emoe"


def test_k8s_manifests_are_consistent() -> None:
    docs = _k8s_docs()
    by_kind = {d["kind"]: d for d in docs}
    cm = by_kind["ConfigMap"]
    assert cm["data"]["agent.toml"] == (DEPLOY / "configs/k8s.toml").read_text()
    svc, ds = by_kind["Service"], by_kind["DaemonSet"]
    assert svc["spec"]["clusterIP"] == "None"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    spec = ds["spec"]["template"]["spec"]
    vols = {v["name"]: v for v in spec["volumes"]}
    assert any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in vols.values())
    agent = spec["containers"][0]
    for ctr in _k8s_containers():  # every --config an emoe command reads is on a mounted volume
        mounts = [m["mountPath"] for m in ctr.get("volumeMounts", [])]
        for argv in emoe_commands_in_argv([*ctr.get("command", []), *ctr.get("args", [])]):
            cfg = argv[argv.index("--config") + 1]
            assert any(cfg.startswith(m.rstrip("/") + "/") for m in mounts), (ctr["name"], cfg)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).is_file() for r in kust["resources"])
    # the init container rewrites node_id per node: the template has exactly one such line, and the result
    # is still a valid config; the TLS dir the config names is the mounted Secret
    text = cm["data"]["agent.toml"]
    assert len(re.findall(r"^node_id = .*$", text, flags=re.M)) == 1
    import tomllib
    cfg = from_dict(tomllib.loads(re.sub(r"^node_id = .*$", 'node_id = "gpu-node-3"', text, flags=re.M)))
    assert cfg.node_id == "gpu-node-3" and "gpu-node-3" in cfg.seed_map
    assert cfg.tls.cert_dir in [m["mountPath"] for m in agent["volumeMounts"]]
    # gRPC probes cannot do mTLS: with TLS on they must hit the plaintext health listener
    probe_addr = cfg.tls.health_listen if cfg.tls.cert_dir else cfg.listen
    assert probe_addr, "TLS is on but [tls] health_listen is not set: kubelet's gRPC probe would fail"
    probe_port = int(probe_addr.rsplit(":", 1)[1])
    assert agent["readinessProbe"]["grpc"]["port"] == agent["livenessProbe"]["grpc"]["port"] == probe_port
    ports = {p["containerPort"] for p in agent["ports"]}
    assert int(cfg.listen.rsplit(":", 1)[1]) in ports and probe_port in ports
    assert {p["port"] for p in svc["spec"]["ports"]} == {int(cfg.listen.rsplit(":", 1)[1])}
    assert cfg.data_dir == vols["data"]["hostPath"]["path"]


@pytest.mark.parametrize("name", ["lan.toml", "k8s.toml"])
def test_network_configs_use_tls(name: str) -> None:
    """The example LAN and Kubernetes configs listen off loopback, so they must use mutual TLS."""
    import tomllib

    cfg = from_dict(tomllib.loads((DEPLOY / "configs" / name).read_text()))
    assert not is_loopback(cfg.listen) and cfg.tls.cert_dir and not cfg.tls.insecure


def test_k8s_check_sees_what_the_agent_uses() -> None:
    """The init container's `--check` tries the data dir and reads the TLS files: it mounts both where the
    agent container does."""
    init = next(c for c in _daemonset()["spec"]["template"]["spec"]["initContainers"] if k8s_commands_of(c))
    agent = _daemonset()["spec"]["template"]["spec"]["containers"][0]
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    for m in agent["volumeMounts"]:
        if m["name"] in ("data", "tls"):
            assert mounts.get(m["name"]) == m["mountPath"], m


def k8s_commands_of(ctr: dict[str, Any]) -> list[list[str]]:
    return [a for a in emoe_commands_in_argv([*ctr.get("command", []), *ctr.get("args", [])]) if "--check" in a]


def test_compose_references_existing_configs() -> None:
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    agents = [s for s in services.values() if emoe_commands_in_argv([*_argv(s.get("entrypoint")),
                                                                    *_argv(s.get("command"))])]
    assert len(agents) == 3 and "etcd" in services
    import tomllib
    for s in agents:
        (argv,) = emoe_commands_in_argv([*_argv(s["entrypoint"]), *_argv(s["command"])])
        target = argv[argv.index("--config") + 1]
        (src,) = [v.split(":")[0] for v in s["volumes"] if v.split(":")[1] == target]
        path = (COMPOSE.parent / src).resolve()
        assert path.is_file(), path
        cfg = from_dict(tomllib.loads(path.read_text()))
        assert cfg.node_id == s["hostname"] and cfg.consensus.etcd_endpoints == ["etcd:2379"]
        assert all(addr.split(":")[0] in services for addr in cfg.seed_map.values())
    build = services["node1"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve().is_file()
