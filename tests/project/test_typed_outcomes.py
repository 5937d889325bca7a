"""Outcomes are typed: the product never decides anything by searching the text of a reason (CONVENTIONS 14).

An outcome's words (a refusal's reason, a decision's trigger, an error's message) are for people; what code
branches on is a code beside them (an enum in the proto, a StrEnum in Python). This test reads controlplane/,
agent/ and dataplane_shim/ and flags every text test on an outcome string.

What counts as an outcome string (the rule, precisely):
- a Name or Attribute whose last identifier, leading underscores dropped, is one of OUTCOME_WORDS or ends in
  `_` plus one of them (`reason`, `m.reason`, `refuse_reason`, `self._why`, `plan.trigger`, `msg`);
- an item of a collection of them: a subscript of a name ending in one of COLLECTION_WORDS (`reasons[0]`);
- the same wrapped in `str(...)`, `.lower()` / `.upper()` / `.strip()` / `.casefold()`, a subscript
  (`why[:9]`) or an `or` (`why or ""`);
- a loop or comprehension variable bound by iterating such a name or a collection of refusals
  (COLLECTION_WORDS: `for r in att.rejects.values()`, `any(... for r in reasons)`; `.values()`, `.items()`
  (its value), `sorted`, `list`, `reversed`, `set`, `tuple` are seen through), within that loop;
- a local Name assigned (a single `x = ...`) from an outcome string, within that function.

What counts as a text test:
- `in` / `not in` with an outcome string as the container (`"parent" in r`), or as the element looked up in a
  literal tuple/list/set of strings (`why in ("A", "B")`);
- `==` / `!=` between an outcome string and a non-empty string literal (an empty one only asks "is there one?");
- a call of TEXT_METHODS on an outcome string (`why.startswith("INVALID_ARGUMENT")`, `trigger.split(":")`);
- a call of `re.<anything>(...)`, or of a compiled pattern's match/search/fullmatch/findall/finditer/sub/subn,
  with an outcome string among its arguments.

ALLOWED names the few functions that may look at such text, each with why; nothing else may. An allowed
entry that no longer matches anything fails too, so the list cannot outlive the code it excuses.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controlplane", "agent", "dataplane_shim")

OUTCOME_WORDS = ("reason", "why", "message", "msg", "trigger", "detail", "error_text")
COLLECTION_WORDS = ("reasons", "messages", "triggers", "details", "rejects", "rejections", "refusals")
_OUTCOME = re.compile(r"(?:^|_)(?:" + "|".join(OUTCOME_WORDS) + ")$")
_COLLECTION = re.compile(r"(?:^|_)(?:" + "|".join(COLLECTION_WORDS) + ")$")
TEXT_METHODS = {"startswith", "endswith", "find", "rfind", "index", "rindex", "count", "split", "rsplit",
                "partition", "rpartition", "removeprefix", "removesuffix"}
PATTERN_METHODS = {"match", "search", "fullmatch", "findall", "finditer", "sub", "subn"}
_SEE_THROUGH_CALLS = {"lower", "upper", "strip", "lstrip", "rstrip", "casefold"}
_SEE_THROUGH_ITER = {"values", "sorted", "list", "reversed", "set", "tuple"}

# (path, the enclosing function's qualified name): why it may read the words of an outcome.
ALLOWED: dict[tuple[str, str], str] = {
    # a reply of a release before codes has only words: the one adapter that gives it its code (tests/upgrade
    # runs that release against this one)
    ("agent/consensus/refusal.py", "legacy_refusal"): "a Paxos refusal of a release before Refusal codes",
    ("agent/consensus/refusal.py", "control_refusal"): "a control ack of a release before ControlRefusal codes",
    ("agent/wire.py", "legacy_plan"): "a plan written before Plan.kind and Plan.forced (its trigger's prefix)",
    ("agent/admin/answer.py", "legacy_own_answer"): "an admin answer of a release before its trailing code",
    # not an outcome of ours: another library's error text, read to name the bad field or hint at a fix
    ("agent/config.py", "from_dict"): "msgspec's ValidationError names the field only in its message",
    ("agent/cli/connect.py", "unavailable_reason"):
        "gRPC's transport detail (connection refused, handshake, socket closed): it has no finer code than "
        "UNAVAILABLE, and the words only choose the hint printed",
}


def _last_identifier(e: ast.expr) -> str | None:
    if isinstance(e, ast.Name):
        return e.id.lstrip("_")
    if isinstance(e, ast.Attribute):
        return e.attr.lstrip("_")
    return None


class _Finder(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path = path
        self.scope: list[str] = []
        self.bound: list[set[str]] = [set()]  # outcome-bound local names, innermost scope last
        self.found: list[tuple[str, str, str, int, str]] = []  # (path, qualname, expression, line, rule)

    # ---- what is an outcome string --------------------------------------------------------------------
    def outcome(self, e: ast.expr) -> bool:
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Name) and f.id == "str" and len(e.args) == 1:
                return self.outcome(e.args[0])
            if isinstance(f, ast.Attribute) and f.attr in _SEE_THROUGH_CALLS:
                return self.outcome(f.value)
            return False
        if isinstance(e, ast.Subscript):
            return self.outcome(e.value) or self._collection(e.value)[0]
        if isinstance(e, ast.BoolOp) and isinstance(e.op, ast.Or):
            return any(self.outcome(v) for v in e.values)
        if isinstance(e, ast.Name) and any(e.id in b for b in self.bound):
            return True
        name = _last_identifier(e)
        return name is not None and bool(_OUTCOME.search(name))

    def _collection(self, e: ast.expr) -> tuple[bool, bool]:
        """(is `e` a collection of outcome strings, do its items come as (key, value) pairs)."""
        pairs = False
        while isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Attribute) and f.attr in ("values", "items"):
                pairs = pairs or f.attr == "items"
                e = f.value
            elif isinstance(f, ast.Name) and f.id in _SEE_THROUGH_ITER and e.args:
                e = e.args[0]
            else:
                return False, False
        if isinstance(e, ast.Name) and any(e.id in b for b in self.bound):
            return True, pairs
        name = _last_identifier(e)
        return name is not None and bool(_COLLECTION.search(name)), pairs

    def _targets(self, target: ast.expr, it: ast.expr) -> set[str]:
        ok, pairs = self._collection(it)
        if not ok:
            return set()
        if pairs:
            if isinstance(target, ast.Tuple) and len(target.elts) == 2 and isinstance(target.elts[1], ast.Name):
                return {target.elts[1].id}
            return set()
        return {target.id} if isinstance(target, ast.Name) else set()

    # ---- scopes ---------------------------------------------------------------------------------------
    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.bound.append(set())
        if not isinstance(node, ast.ClassDef):
            for sub in ast.walk(node):  # a local assigned from an outcome string is one
                if (isinstance(sub, ast.Assign) and len(sub.targets) == 1 and isinstance(sub.targets[0], ast.Name)
                        and self.outcome(sub.value)):
                    self.bound[-1].add(sub.targets[0].id)
        self.generic_visit(node)
        self.bound.pop()
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _function

    def visit_For(self, node: ast.For) -> None:
        self.visit(node.iter)
        self.bound.append(self._targets(node.target, node.iter))
        for s in node.body + node.orelse:
            self.visit(s)
        self.bound.pop()

    visit_AsyncFor = visit_For

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> None:
        names: set[str] = set()
        for gen in node.generators:
            self.visit(gen.iter)
            names |= self._targets(gen.target, gen.iter)
        self.bound.append(names)
        for gen in node.generators:
            for cond in gen.ifs:
                self.visit(cond)
        if isinstance(node, ast.DictComp):
            self.visit(node.key)
            self.visit(node.value)
        else:
            self.visit(node.elt)
        self.bound.pop()

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    # ---- the text tests -------------------------------------------------------------------------------
    def _flag(self, node: ast.expr, rule: str) -> None:
        self.found.append((self.path, ".".join(self.scope) or "<module>", ast.unparse(node), node.lineno, rule))

    def visit_Compare(self, node: ast.Compare) -> None:
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)):
                if self.outcome(right):
                    self._flag(node, "substring test on an outcome string")
                elif (self.outcome(left) and isinstance(right, (ast.Tuple, ast.List, ast.Set))
                      and any(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in right.elts)):
                    self._flag(node, "outcome string looked up among literal strings")
            elif isinstance(op, (ast.Eq, ast.NotEq)):
                for a, b in ((left, right), (right, left)):
                    if self.outcome(a) and isinstance(b, ast.Constant) and isinstance(b.value, str) and b.value:
                        self._flag(node, "outcome string compared with a literal")
                        break
            left = right
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Attribute):
            if f.attr in TEXT_METHODS and self.outcome(f.value):
                self._flag(node, f"str.{f.attr} on an outcome string")
            elif ((isinstance(f.value, ast.Name) and f.value.id == "re") or f.attr in PATTERN_METHODS) and any(
                    self.outcome(a) for a in node.args):
                self._flag(node, "regular expression on an outcome string")
        self.generic_visit(node)


def find(root: Path = ROOT) -> Iterator[tuple[str, str, str, int, str]]:
    """Every text test on an outcome string under `root`'s product packages: (path, qualname, expr, line, rule)."""
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            finder = _Finder(rel)
            finder.visit(ast.parse(f.read_text(), filename=rel))
            yield from finder.found


def test_no_code_branches_on_the_text_of_an_outcome() -> None:
    found = list(find())
    bad = [f"{p}:{line} in {q}: {e}  ({rule})" for p, q, e, line, rule in found if (p, q) not in ALLOWED]
    assert not bad, "text tests on outcome strings (branch on a code instead):\n" + "\n".join(bad)
    used = {(p, q) for p, q, _, _, _ in found}
    stale = sorted(k for k in ALLOWED if k not in used)
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def _offenders(src: str) -> list[str]:
    finder = _Finder("x.py")
    finder.visit(ast.parse(src))
    return [e for _, _, e, _, _ in finder.found]


def test_the_rule_catches_each_kind_of_text_test() -> None:
    """The finder itself can fail: each form it must catch is caught, and the look-alikes it must leave are left."""
    caught = {
        'def f(att):\n    return any("parent" in r or r.startswith("UNAVAILABLE") for r in att.rejects.values())\n':
            ["'parent' in r", "r.startswith('UNAVAILABLE')"],
        'def f(m):\n    if "promised" in m.reason:\n        pass\n': ["'promised' in m.reason"],
        'def f(why):\n    return why.startswith("INVALID_ARGUMENT")\n': ["why.startswith('INVALID_ARGUMENT')"],
        'def f(trigger):\n    return trigger.split(":", 1)[0]\n': ["trigger.split(':', 1)"],
        'import re\ndef f(msg):\n    return re.match("x", msg)\n': ["re.match('x', msg)"],
        'def f(plan):\n    return plan.trigger.partition(" ")\n': ["plan.trigger.partition(' ')"],
        'def f(reply):\n    r = reply.reason\n    return r.find("x")\n': ["r.find('x')"],
        'def f(s):\n    return s.refuse_reason == "STALE"\n': ["s.refuse_reason == 'STALE'"],
        'def f(why):\n    return why in ("A", "B")\n': ["why in ('A', 'B')"],
        'def f(rs):\n    for k, r in rs.reasons.items():\n        if "x" in str(r).lower():\n            pass\n':
            ["'x' in str(r).lower()"],
        'def f(pat, e):\n    return pat.search(e.message)\n': ["pat.search(e.message)"],
    }
    for src, want in caught.items():
        assert _offenders(src) == want, src
    left = [
        'def f(r, reasons):\n    return "parent" in r.table\n',  # r is not bound from reasons here
        'def f(reason):\n    return reason == ""\n',  # is there a reason: not a text test
        'def f(code, reasons):\n    return code in reasons\n',  # a code looked up in a collection
        'def f(s):\n    return s.split(",")\n',
        'def f(counts, reason):\n    counts[reason] = 1\n',
    ]
    for src in left:
        assert _offenders(src) == [], src
