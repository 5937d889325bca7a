"""README.md is an entry read in five minutes and docs/ holds the depth (issue 50): the README stays under
1,800 words and links every page of docs/; every relative link in the README and in docs/ reaches a file
(and, with an anchor, a heading of it); every repository path they name in code exists; every `make` target,
`emoe` command (its subcommands and flags) and `python -m` module they name exists; and every command the
README itself gives is run by a test or by CI (RUN_BY says where)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from agent.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAKEFILE = ROOT / "Makefile"
MAX_WORDS = 1800


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def documents() -> list[Path]:
    return [README, *pages()]


# Every command the README gives, and where a test or CI runs it: (file, what that file says when it runs it).
RUN_BY: dict[str, tuple[str, str]] = {
    "make demo": ("tests/deploy/test_installed_agents.py", '"demo", "--segment-steps"'),  # the recipe: emoe demo
    "make test": (".ci/run", "make test"),
    "make image": ("tests/deploy/test_manifests.py", '["make", "-n", "-s", "image"]'),  # and its Dockerfile
    "emoe --help": ("tests/project/test_install.py", '(["--help"]'),
    "emoe demo --help": ("tests/project/test_install.py", '["demo", "--help"]'),
    "emoe status": ("tests/agent/test_cli_parse.py", 'main(["status"'),
}


# ---- reading markdown ---------------------------------------------------------------------------------

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")


def prose(text: str) -> str:
    """The text without code: fenced blocks and inline spans (a `[x](y)` in code is no link)."""
    return INLINE.sub("", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """Every line of a fenced block (a trailing ` # comment` cut) and every inline span, `\\|` unescaped."""
    lines = [ln.split(" #", 1)[0] for block in FENCE.findall(text) for ln in block.splitlines()]
    spans = INLINE.findall(FENCE.sub("", text))
    return [s.replace("\\|", "|") for s in [*lines, *spans] if s.strip()]


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", prose(text))


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", FENCE.sub("", text), flags=re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def dead_links(path: Path, text: str | None = None) -> list[str]:
    """The relative links of `path` (its text, or `text` as if it were there) that reach no file, a file
    outside the repository, or an anchor that no heading of the target makes."""
    text = path.read_text() if text is None else text
    dead = []
    for link in links(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto: ...: not a file of this repository
            continue
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        if not target.is_relative_to(ROOT) or not target.exists():
            dead.append(link)
        elif anchor and target.suffix == ".md" and anchor not in anchors(text if not file else target.read_text()):
            dead.append(link)
    return dead


def linked_files(path: Path) -> set[Path]:
    return {(path.parent / link.partition("#")[0]).resolve() for link in links(path.read_text())
            if link.partition("#")[0] and not re.match(r"[a-z][a-z0-9+.-]*:", link)}


# ---- commands named in code -----------------------------------------------------------------------------

STOP = {"|", "||", "&&", ";", ">", "2>&1"}


def _commands(text: str, word: str) -> list[list[str]]:
    """The argv after every `word` (or .../word) that starts a command in the code of `text`."""
    out = []
    for span in code(text):
        toks = span.split()
        for i, t in enumerate(toks):
            before = toks[i - 1] if i else ";"
            if t.rsplit("/", 1)[-1] == word and (before in STOP or i == 0 or before in ("exec", "sudo")):
                argv = []
                for a in toks[i + 1:]:
                    if a in STOP:
                        break
                    argv.append(a)
                out.append(argv)
    return out


def make_targets(text: str) -> set[str]:
    return {argv[0] for argv in _commands(text, "make") if argv and re.fullmatch(r"[A-Za-z][\w-]*", argv[0])}


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", MAKEFILE.read_text(), flags=re.M))


def emoe_commands(text: str) -> list[list[str]]:
    return _commands(text, "emoe")


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def check_emoe(argv: list[str], root: argparse.ArgumentParser) -> None:
    """Raises AssertionError naming an unknown subcommand or flag. Words after the subcommands are placeholders
    or values, so only flags are checked there; `a|b` names two alternatives."""
    parsers, path, rest = [root], ["emoe"], [a for a in argv if a.strip("[](),.")]
    while rest and (subs := _subparsers(parsers[0])) and not rest[0].lstrip("[").startswith("-"):
        alts = rest.pop(0).strip("[]").split("|")
        missing = [a for a in alts if a not in subs]
        assert not missing, f"`{' '.join(path)} {missing[0]}`: no such subcommand (have {sorted(subs)})"
        parsers = [subs[a] for a in alts]
        path.append("|".join(alts))
    for tok in rest:
        flag = tok.strip("[](),.;:'\"").split("=", 1)[0]
        if re.fullmatch(r"--?[A-Za-z][\w-]*", flag):
            for p in parsers:
                known = {s for a in [*p._actions, *root._actions] for s in a.option_strings}
                assert flag in known, f"`{' '.join(path)}`: no flag {flag} (have {sorted(known)})"


def python_modules(text: str) -> set[str]:
    return {argv[1] for word in ("python", "python3") for argv in _commands(text, word)
            if len(argv) > 1 and argv[0] == "-m"}


def module_runs(name: str) -> bool:
    """`python -m name` would find something to run: a module, or a package with a __main__."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return False
    if spec is None:
        return False
    return not spec.submodule_search_locations or importlib.util.find_spec(f"{name}.__main__") is not None


TOP = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".") and
             p.name not in ("out", "build") and not p.name.endswith(".egg-info"))


def repo_paths(text: str) -> set[str]:
    """Paths under one of the repository's top-level folders named in code (not a pattern like `k8s/*.yaml`)."""
    tops = "|".join(map(re.escape, TOP))
    pat = re.compile(rf"(?<![\w./-])((?:{tops})/[\w./-]*[\w/])")
    return {m for span in code(text) if not re.search(r"[{*<]", span) for m in pat.findall(span)}


def readme_commands(text: str) -> set[str]:
    return ({f"make {t}" for t in make_targets(text)} |
            {" ".join(["emoe", *argv]) for argv in emoe_commands(text) if argv})  # a bare `emoe` names the program


# ---- the README is an entry ----------------------------------------------------------------------------

def test_the_readme_is_read_in_five_minutes() -> None:
    n = len(README.read_text().split())
    assert n < MAX_WORDS, f"README.md has {n} words (under {MAX_WORDS}: move the depth to docs/)"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    files = {p.resolve() for p in DOCS.rglob("*") if p.is_file()}
    assert {p.resolve() for p in pages()} <= files and len(pages()) >= 5
    unlinked = sorted(p.relative_to(ROOT).as_posix() for p in files - linked_files(README))
    assert not unlinked, f"not linked from README.md: {unlinked}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path: Path) -> None:
    assert links(path.read_text()), f"{path.name} links nothing"
    assert not dead_links(path), f"{path.relative_to(ROOT)}: dead links {dead_links(path)}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_repository_path_named_exists(path: Path) -> None:
    missing = sorted(p for p in repo_paths(path.read_text()) if not (ROOT / p).exists())
    assert not missing, f"{path.relative_to(ROOT)} names {missing}"


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_named_exists(path: Path) -> None:
    text = path.read_text()
    unknown = sorted(make_targets(text) - makefile_targets())
    assert not unknown, f"{path.relative_to(ROOT)}: no make target {unknown} in the Makefile"
    root = build_parser()
    for argv in emoe_commands(text):
        check_emoe(argv, root)
    absent = sorted(m for m in python_modules(text) if not module_runs(m))
    assert not absent, f"{path.relative_to(ROOT)}: `python -m` finds nothing to run for {absent}"


def test_every_readme_command_is_run_by_a_test_or_ci() -> None:
    named = readme_commands(README.read_text())
    assert {"make demo", "make test"} <= named  # the two commands, first
    unrun = sorted(named - RUN_BY.keys())
    assert not unrun, f"README.md gives {unrun}: say in RUN_BY which test or CI step runs each"
    for cmd in sorted(named):
        where, says = RUN_BY[cmd]
        assert says in (ROOT / where).read_text(), f"{where} no longer runs `{cmd}` ({says!r} not found)"
    demo = re.search(r"^demo:.*\n((?:\t.*\n)+)", MAKEFILE.read_text(), flags=re.M)
    assert demo and "emoe demo" in demo.group(1)  # what the installed-wheel test runs is what `make demo` runs


# ---- the checkers can fail -----------------------------------------------------------------------------

def test_the_checkers_catch_what_they_are_for() -> None:
    bad = ("# T\n## A heading\nSee [gone](docs/nowhere.md), [bad anchor](#no-such-heading), "
           "[fine](#a-heading), [outside](../../etc/passwd) and [web](https://example.com).\n"
           "```\nmake demo\nmake deploy   # no such target\n```\n"
           "Run `emoe stauts`, `emoe drain 3 --forse`, `emoe store check|repair --config F`, "
           "`python -m bench.nosuch` and `agent/nosuch.py`.\n")
    assert dead_links(README, bad) == ["docs/nowhere.md", "#no-such-heading", "../../etc/passwd"]
    assert make_targets(bad) - makefile_targets() == {"deploy"}
    root = build_parser()
    argvs = emoe_commands(bad)
    assert argvs[2] == ["store", "check|repair", "--config", "F"]
    check_emoe(argvs[2], root)
    with pytest.raises(AssertionError, match="no such subcommand"):
        check_emoe(argvs[0], root)
    with pytest.raises(AssertionError, match="no flag --forse"):
        check_emoe(argvs[1], root)
    assert python_modules(bad) == {"bench.nosuch"} and not module_runs("bench.nosuch")
    assert module_runs("chaos") and module_runs("bench.heldout") and not module_runs("controlplane")
    assert repo_paths(bad) == {"agent/nosuch.py"}
    assert readme_commands(bad) - RUN_BY.keys() == {"make deploy", "emoe stauts", "emoe drain 3 --forse",
                                                    "emoe store check|repair --config F"}
    assert len(("word " * MAX_WORDS).split()) >= MAX_WORDS  # the count the length test uses
