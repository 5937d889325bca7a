"""Reading deploy/ as its tools do: the Dockerfile's install line, the compose agents' commands, and a small
kustomize renderer (resources, namespace, images, secretGenerator: all that deploy/k8s uses, and it refuses any
other field), checked against `kubectl kustomize` where kubectl is installed (tests/deploy/test_manifests.py)."""

from __future__ import annotations

import base64
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
COMPOSE = DEPLOY / "compose" / "docker-compose.yml"
K8S = DEPLOY / "k8s"
VERSION: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
IMAGE_REPO = "elasticmoe/emoe"


# ---- the Dockerfile ----------------------------------------------------------------------------------

def dockerfile_runs() -> list[str]:
    """Each RUN instruction's shell command, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [m.group(1).strip() for m in re.finditer(r"^RUN\s+(.*)$", text, flags=re.M)]


def dockerfile_install() -> tuple[list[str], str, str]:
    """The agent's install line (the one `pip install` into the image's venv), as argv, with the venv the line
    installs into and the source directory it installs (the COPY destination)."""
    cmds = [shlex.split(c) for run in dockerfile_runs() for c in run.split("&&")]
    venvs = [argv[-1] for argv in cmds if argv[1:3] == ["-m", "venv"]]
    (venv,) = venvs
    (install,) = [argv for argv in cmds if argv[:2] == [f"{venv}/bin/pip", "install"]]
    (copy,) = re.findall(r"^COPY\s+\.\s+(\S+)$", DOCKERFILE.read_text(), flags=re.M)
    return install, venv, copy


# ---- docker compose ----------------------------------------------------------------------------------

def compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return doc


def _argv(v: Any) -> list[str]:
    return shlex.split(v) if isinstance(v, str) else list(v or [])


def compose_agents() -> dict[str, dict[str, Any]]:
    """The services that run `emoe` (entrypoint + command), by name."""
    return {name: s for name, s in compose()["services"].items()
            if _argv(s.get("entrypoint"))[:1] == ["emoe"]}


def service_argv(service: dict[str, Any]) -> list[str]:
    return [*_argv(service.get("entrypoint")), *_argv(service.get("command"))]


def service_mounts(service: dict[str, Any]) -> dict[str, str]:
    """container path -> host path (relative to the compose file) or volume name."""
    out = {}
    for v in service.get("volumes", []):
        src, dst = v.split(":")[:2]
        out[dst] = src
    return out


# ---- kustomize ---------------------------------------------------------------------------------------

HANDLED = {"apiVersion", "kind", "resources", "namespace", "images", "secretGenerator", "generatorOptions"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass"}


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    if doc.get("kind") == "Pod":
        return [doc["spec"]]
    tmpl = doc.get("spec", {}).get("template", {}).get("spec")
    return [tmpl] if tmpl else []


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for spec in pod_specs(doc) for c in [*spec.get("initContainers", []), *spec.get("containers", [])]]


def split_image(image: str) -> tuple[str, str]:
    """name, tag ("" without one; digests are not used here)."""
    name, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:
        return image, ""
    return name, tag


def render(kdir: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize kdir` prints, as documents, for the fields deploy/k8s uses."""
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    unknown = set(k) - HANDLED
    if unknown:
        raise NotImplementedError(f"{kdir}/kustomization.yaml: {sorted(unknown)}: not rendered by this test")
    docs: list[dict[str, Any]] = []
    for r in k.get("resources", []):
        path = kdir / r
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    opts = k.get("generatorOptions", {})
    for g in k.get("secretGenerator", []):
        if not opts.get("disableNameSuffixHash"):
            raise NotImplementedError("secretGenerator with a name suffix hash")
        data = {}
        for f in g.get("files", []):
            key, sep, src = f.partition("=")
            key, src = (key, src) if sep else (Path(f).name, f)
            data[key] = base64.b64encode((kdir / src).read_bytes()).decode()
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": g["name"]},
                     "type": g.get("type", "Opaque"), "data": data})
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d.setdefault("metadata", {})["namespace"] = k["namespace"]
    for img in k.get("images", []):
        for d in docs:
            for c in containers(d):
                name, tag = split_image(c["image"])
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return docs


def kustomize_binary() -> list[str] | None:
    """`kustomize build` or `kubectl kustomize`, whichever is installed (`make kustomize` installs kubectl)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def kustomize(kdir: Path) -> list[dict[str, Any]]:
    tool = kustomize_binary()
    if tool is None:
        raise FileNotFoundError("neither kustomize nor kubectl is installed")
    r = subprocess.run([*tool, str(kdir)], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(tool)} {kdir}: {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}
