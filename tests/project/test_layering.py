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
        "import agent.process\n"
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


# agent/'s subsystems follow a load report's trip (engine link -> gossip -> decision -> commit backend ->
# admin), each a package whose manual (its __init__ docstring) names what it may import. A unit is a package
# of agent/ or one of its top-level modules; each may import only itself and what it lists here (a unit, or
# one named module of a unit). agent.state (the wiring) and agent.process (the process) stand on everything below.
AGENT_ALLOWED: dict[str, set[str]] = {
    # the base: no subsystem beneath it
    "clock": set(),
    "configcheck": set(),
    "wire": set(),
    "security": {"transport"},  # transport.methods names the RPCs security authorizes
    "decode_guard": {"security"},
    "wireversion": {"security"},
    # the config assembles its sections, two of which are leaf modules of gossip and one of link
    "config": {"configcheck", "agent.gossip.gossipconfig", "agent.gossip.claims", "agent.link.reportguard"},
    # the packages, bottom up
    "storage": set(),
    "transport": {"clock", "wireversion", "security"},
    "link": {"clock", "decode_guard", "wireversion", "security"},
    "gossip": {"clock", "config", "configcheck", "transport", "link", "security"},
    "consensus": {"clock", "config", "storage", "transport", "security"},
    "commit": {"consensus"},
    "etcd": {"consensus", "storage"},
    "decision": {"clock", "commit", "wire", "consensus", "gossip", "link"},
    "credentials": {"config", "consensus", "decode_guard", "security", "wireversion"},
    "fingerprint": {"config", "consensus", "storage"},
    "admin": {"clock", "commit", "fingerprint", "security", "wire", "consensus", "decision", "gossip", "link"},
    # the wiring and the process
    "state": {"admin", "clock", "commit", "config", "consensus", "credentials", "decision", "etcd", "fingerprint",
              "gossip", "link", "storage", "transport"},
    "process": {"admin", "config", "credentials", "security", "state", "storage", "transport"},
    "cli": {"admin", "config", "consensus", "process", "security", "state", "storage", "wire"},
}
AGENT_TOP_MODULES_MAX = 12  # besides its packages (issue 50): a flat agent/ hides the trip


def _agent_unit(module: str) -> str:
    """agent.gossip.probe -> gossip; agent.clock -> clock; agent -> agent."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _layer_violations(imports: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(imports.items()):
        if not src.startswith("agent."):
            continue
        unit = _agent_unit(src)
        allowed = AGENT_ALLOWED.get(unit)
        if allowed is None:
            bad.append(f"{src}: its unit {unit!r} has no entry in AGENT_ALLOWED")
            continue
        for t in sorted(targets):
            if not t.startswith("agent.") or _agent_unit(t) == unit:
                continue
            # `from agent.gossip import claims` records agent.gossip too: the package itself counts as its module
            if t in allowed or _agent_unit(t) in allowed:
                continue
            if any(m.startswith(t + ".") and m in allowed for m in targets):
                continue
            bad.append(f"{src} imports {t} ({unit} may import {sorted(allowed) or 'nothing of agent'})")
    return bad


def test_agent_subsystems_import_only_what_their_manual_allows() -> None:
    bad = _layer_violations(_module_imports())
    assert not bad, "imports across agent/'s subsystems that the layering does not allow:\n" + "\n".join(bad)


def test_the_subsystem_rule_sees_an_upward_arrow() -> None:
    imports = _module_imports()
    assert not _layer_violations(imports)
    imports["agent.link.loadpath"] = imports["agent.link.loadpath"] | {"agent.decision.pipeline"}
    imports["agent.storage.store"] = imports["agent.storage.store"] | {"agent.consensus.paxos"}
    imports["agent.config"] = imports["agent.config"] | {"agent.gossip.membership"}
    got = _layer_violations(imports)
    assert [b.split(" (")[0] for b in got] == ["agent.config imports agent.gossip.membership",
                                              "agent.link.loadpath imports agent.decision.pipeline",
                                              "agent.storage.store imports agent.consensus.paxos"], got


def test_every_agent_package_has_its_manual_and_an_entry_in_the_layering() -> None:
    packages = sorted(p.name for p in (ROOT / "agent").iterdir() if (p / "__init__.py").is_file())
    tops = sorted(p.stem for p in (ROOT / "agent").glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(tops) <= AGENT_TOP_MODULES_MAX, f"{len(tops)} top-level modules in agent/: {tops}"
    assert set(packages) | set(tops) == set(AGENT_ALLOWED), (packages, tops)
    for p in packages:
        doc = ast.get_docstring(ast.parse((ROOT / "agent" / p / "__init__.py").read_text())) or ""
        assert "May import" in doc, f"agent/{p}/__init__.py has no manual saying what it may import"


# the config and the consensus core stand apart from the engine side (issue 50): no import of dataplane_shim,
# at the top, lazily inside a function, or through another module of the project they import
ENGINE_FREE = ("agent.config", "agent.consensus")


def _reach(imports: dict[str, set[str]], start: str) -> set[str]:
    """The project modules importing `start` runs: what it imports, their packages, and so on."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        parts = todo.pop().split(".")
        for m in imports.get(".".join(parts), set()) | {".".join(parts[:i]) for i in range(1, len(parts))}:
            if m in imports and m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def _engine_reached(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    """ENGINE_FREE's modules -> the dataplane_shim modules importing them runs (those that run none left out)."""
    starts = sorted(m for m in imports if any(m == p or m.startswith(p + ".") for p in ENGINE_FREE))
    assert "agent.config" in starts and "agent.consensus.core" in starts, starts
    bad = {m: sorted(r for r in _reach(imports, m) if r.split(".")[0] == "dataplane_shim") for m in starts}
    return {m: r for m, r in bad.items() if r}


def test_config_and_consensus_reach_nothing_of_the_engine_side() -> None:
    imports = _module_imports()
    assert not _engine_reached(imports), f"reach the engine side (dataplane_shim): {_engine_reached(imports)}"
    # the rule sees an import two modules away: agent.consensus.node -> agent.config -> agent.configcheck -> ...
    imports["agent.configcheck"] = imports["agent.configcheck"] | {"dataplane_shim.errors"}
    got = _engine_reached(imports)
    assert got["agent.consensus.node"] == got["agent.config"] == ["dataplane_shim", "dataplane_shim.errors"], got
