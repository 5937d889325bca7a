"""Every code the controller can put in an Explain's outcome is one of ready.OUTCOMES, which is built from the
enums that define the codes (decision.DecisionOutcome, planner.Reason, errors.InvalidReason, InvalidTable.code):
no list of codes is copied by hand (one in ready.py's docstring had lost NOT_DESIGNATED, NOTHING_TO_REPAIR and
ROLLBACK_NOT_EXPRESSIBLE), and no site hands out a code as a bare string."""

from __future__ import annotations

import ast
from enum import StrEnum
from pathlib import Path

from controlplane.decision import DecisionOutcome
from controlplane.errors import InvalidReason, InvalidTable
from controlplane.planner import Reason
from controlplane.ready import OUTCOMES
from controlplane.verify import VoterCode

ROOT = Path(__file__).resolve().parents[2]
ENUMS: dict[str, type[StrEnum]] = {"DecisionOutcome": DecisionOutcome, "Reason": Reason,
                                   "InvalidReason": InvalidReason, "VoterCode": VoterCode}
# where a code is handed out: (callee or attribute, index of the code among its positional arguments)
SITES = {"Attempt": 1, "_note": 1, "Refused": 1, "InvalidOperation": 0}


def _code(e: ast.expr) -> tuple[str, str] | None:
    """("enum", "MEMBER") for `Enum.MEMBER` or `Enum.MEMBER.value`, ("str", text) for a literal, else None."""
    if isinstance(e, ast.Attribute) and e.attr == "value":
        e = e.value
    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in ENUMS:
        return e.value.id, e.attr
    if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value:
        return "str", e.value
    return None


def _handed_out() -> list[tuple[str, int, str, str]]:
    """(file, line, enum or "str", member or text) of every code handed out at a SITE, or set as `x.outcome`."""
    out = []
    for f in sorted((ROOT / "controlplane").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            args: list[ast.expr] = []
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in SITES and len(node.args) > SITES[name]:
                    args.append(node.args[SITES[name]])
                args += [k.value for k in node.keywords if k.arg in ("outcome", "reason") and name in SITES]
            elif isinstance(node, ast.Assign):
                if any(isinstance(t, ast.Attribute) and t.attr == "outcome" for t in node.targets):
                    args.append(node.value)
                if isinstance(node.targets[0], ast.Tuple) and isinstance(node.value, ast.Tuple):  # a.outcome, ... =
                    args += [v for t, v in zip(node.targets[0].elts, node.value.elts, strict=False)
                             if isinstance(t, ast.Attribute) and t.attr == "outcome"]
            for a in args:
                c = _code(a)
                if c is not None:
                    out.append((f.relative_to(ROOT).as_posix(), a.lineno, *c))
    return out


def test_every_enum_code_is_an_outcome() -> None:
    assert {"NOT_DESIGNATED", "NOTHING_TO_REPAIR", "ROLLBACK_NOT_EXPRESSIBLE"} <= OUTCOMES
    for enum in (DecisionOutcome, Reason, InvalidReason):
        assert set(enum) <= OUTCOMES, enum
    assert InvalidTable.code in OUTCOMES


def test_every_code_handed_out_is_an_outcome_of_an_enum() -> None:
    found = _handed_out()
    assert len(found) > 40  # the finder sees the sites (Attempt, _note, Refused, InvalidOperation)
    literal = [f"{p}:{line}: {text!r}" for p, line, kind, text in found if kind == "str"]
    assert not literal, f"codes handed out as bare strings (name them in their enum): {literal}"
    missing = [f"{p}:{line}: {kind}.{member}" for p, line, kind, member in found
               if kind != "VoterCode" and ENUMS[kind][member] not in OUTCOMES]
    assert not missing, f"codes an Explain may carry that ready.OUTCOMES lacks: {missing}"
    used = {ENUMS[kind][member] for _, _, kind, member in found if kind != "str"}
    assert {"NOT_DESIGNATED", "NOTHING_TO_REPAIR", "ROLLBACK_NOT_EXPRESSIBLE"} <= used
