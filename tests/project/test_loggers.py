"""One logger naming scheme in the product: every module logs under its own module path,
`logging.getLogger(__name__)` (agent.decision.pipeline, agent.consensus.node, dataplane_shim.install, ...), so a logger's
name says which file wrote a line, and `agent` or `dataplane_shim` sets a whole side's level. The schemes it
replaces (emoe.agent, elasticmoe.plugin, a module borrowing another's name) hid where a line came from."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _misnamed(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of every getLogger(...) call whose argument is not `__name__`."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"
                and not (len(node.args) == 1 and isinstance(node.args[0], ast.Name) and node.args[0].id == "__name__")):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_every_product_logger_is_named_by_its_module() -> None:
    bad = [f"{f.relative_to(ROOT)}:{line}: {call}" for pkg in ("controlplane", "agent", "dataplane_shim")
           for f in sorted((ROOT / pkg).rglob("*.py")) for line, call in _misnamed(ast.parse(f.read_text()))]
    assert not bad, "loggers not named by their module (use logging.getLogger(__name__)):\n" + "\n".join(bad)


def test_the_rule_sees_each_other_scheme() -> None:
    src = ('import logging\na = logging.getLogger("emoe.agent")\nb = logging.getLogger("elasticmoe.plugin")\n'
           'c = logging.getLogger()\nd = logging.getLogger(__name__)\n')
    assert [line for line, _ in _misnamed(ast.parse(src))] == [2, 3, 4]
