"""The design's import rules: controlplane is pure; dataplane_shim never imports agent; the product
(controlplane, agent, dataplane_shim) imports nothing from its harness (bench, chaos), anywhere in a module: the
harness's CLI commands register through the `elasticmoe.cli` entry point group instead. Of the two harness
packages, chaos is the base and bench stands on it: no arrow back up."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FORBIDDEN = {
    "controlplane": {"asyncio", "grpc", "socket", "time", "random", "agent", "dataplane_shim", "threading",
                     "subprocess", "elasticmoe", "bench", "chaos"},
    "dataplane_shim": {"agent", "bench", "chaos"},
    "agent": {"bench", "chaos"},
    "chaos": {"bench"},  # the two harness packages are layered: bench (demo, figures) stands on chaos
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.add(node.args[0].value.split(".")[0])  # importlib.import_module("bench.x") is an import too
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_rules(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"{package}/ has no Python files"
    bad = {str(f.relative_to(ROOT)): sorted(_imports(f) & FORBIDDEN[package]) for f in files}
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"forbidden imports: {bad}"


def test_agent_and_controlplane_import_without_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import controlplane.table, controlplane.load, controlplane.ops, agent.config, agent.cli\n"
        "import agent.node\n"
        "agent.cli.build_parser()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


PRODUCT = ("agent", "controlplane", "dataplane_shim")
# what the product's users load by name, not by import: the CLI script, the engines' plugin entry points and
# their engine-side adapters, and `python -m` entry points
ENTRY = {"agent.cli", "agent.cli.__main__", "agent.__main__", "dataplane_shim.vllm_plugin",
         "dataplane_shim.sglang_plugin",
         # the library an engine that installs per rank imports (the router with version counters, its CUDA
         # kernel): engine code, not this repository, is its user
         "dataplane_shim.shim", "dataplane_shim.cuda",
         # the in-memory transport beside the real one, by design (memberlist keeps its mock transport in the
         # package): the simulator and the tests run the product's own protocol code over it
         "agent.transport.sim",
         # baselines the decision core is measured against (CRAFT is also a planner: controlplane.planners)
         "controlplane.baselines.hindsight", "controlplane.baselines.static"}


def _module_imports() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in it, annotations included)."""
    mods: dict[str, Path] = {}
    for p in (*PRODUCT, "bench", "chaos"):
        for f in (ROOT / p).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    out: dict[str, set[str]] = {}
    for name, f in mods.items():
        got: set[str] = set()
        pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text(), filename=str(f))):
            if isinstance(node, ast.ImportFrom) and (node.module or node.level):
                base = ".".join(pkg[:len(pkg) - node.level + 1] + [node.module or ""]).strip(".") if node.level \
                    else str(node.module)
                got |= {base, *(f"{base}.{a.name}" for a in node.names)}
            elif isinstance(node, ast.Import):
                got |= {a.name for a in node.names}
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                got.add(node.value)  # a module named for importlib (the CLI's subcommand modules)
        out[name] = {m for m in got if m in mods and m != name}
    return out


def test_no_product_module_serves_only_the_harness() -> None:
    """Every module of the product is used by the product (or is an entry point users load by name): a
    simulator, test server or fault hook that only bench/, chaos/ or the tests import belongs there."""
    imports = _module_imports()
    used = {m for src, ms in imports.items() if src.split(".")[0] in PRODUCT for m in ms}
    product = {m for m in imports if m.split(".")[0] in PRODUCT}
    packages = {m for m in product if (ROOT / m.replace(".", "/")).is_dir()}
    orphans = sorted(product - used - ENTRY - packages)
    assert not orphans, f"product modules that only the harness uses: {orphans}"
