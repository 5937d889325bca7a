"""`emoe`: the ElasticMoE command line. Each subcommand lives in its own module with a `register`; commands
from other installed packages (the benchmark harness's `bench`, `demo`, `trace import`) register through the
`elasticmoe.cli` entry point group, so the product imports none of them.

May import: agent.process and agent.state (to run an agent), agent.admin (its client side), agent.config,
agent.consensus, agent.security, agent.storage, agent.wire (tests/project/test_layering.py)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, entry_points, version

from agent.cli import exits
from agent.cli.argtypes import float_in

# Modules that add subcommands: each defines register(subparsers) and sets `func` on its parsers.
COMMAND_MODULES = (
    "agent.cli.run_agent",
    "agent.cli.admin",
    "agent.cli.certs",
    "agent.cli.profile",
    "agent.cli.store",
)

PLUGIN_GROUP = "elasticmoe.cli"  # entry points: register(subparsers), called after the product's own commands


def package_version() -> str:
    """The installed `elasticmoe` distribution's version (pyproject.toml's), or a note that it is not installed."""
    try:
        return version("elasticmoe")
    except PackageNotFoundError:
        return "unknown (the elasticmoe package is not installed)"


def add_timeout(p: argparse.ArgumentParser, default: object = argparse.SUPPRESS) -> None:
    """`--timeout S`: seconds each RPC to an agent may take. On a command's own parser it defaults to
    SUPPRESS, so that `emoe --timeout 3 status` and `emoe status --timeout 3` both work."""
    p.add_argument("--timeout", type=float_in(0.0, 3600.0, lo_open=True), default=default, metavar="S",
                   help="seconds each RPC to an agent may take (default: 5; 30 for propose, drain and restore, "
                        "which wait for a commit)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emoe", description="ElasticMoE control plane", epilog=exits.EPILOG)
    parser.add_argument("--version", action="version", version=f"emoe {package_version()}",
                        help="print the package version and exit")
    add_timeout(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()(sub)
        except Exception as e:  # noqa: BLE001 - a broken plugin costs its commands, not the CLI
            print(f"emoe: commands from {ep.value} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    for cmd, help_text in commands(parser):  # `emoe drain --help` says what drain does, as `emoe --help` does
        if cmd.description is None and help_text:
            cmd.description = help_text[:1].upper() + help_text[1:] + "."
        if cmd.epilog is None:
            cmd.epilog = exits.EPILOG
    return parser


def commands(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.ArgumentParser, str]]:
    """Every (sub)command's parser under `parser`, with its one-line help, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, p in action.choices.items():
                yield p, helps.get(name, "")
                yield from commands(p)


EXIT_CLOSED_PIPE = exits.CLOSED_PIPE


def _stdout_to_devnull() -> None:
    """Point the stdout descriptor at /dev/null, so that the interpreter's last flush of what is still
    buffered does not raise BrokenPipeError again at exit (the recipe in Python's `signal` documentation)."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a file descriptor: nothing is flushed to one at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a reader that went away shows here, not as a traceback at exit
    except BrokenPipeError:
        _stdout_to_devnull()
        return EXIT_CLOSED_PIPE


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return exits.USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return exits.INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
