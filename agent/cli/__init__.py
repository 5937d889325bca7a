"""`emoe`: the ElasticMoE command line. Each subcommand lives in its own module with a `register`; commands
from other installed packages (the benchmark harness's `bench`, `demo`, `trace import`) register through the
`elasticmoe.cli` entry point group, so the product imports none of them."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

# Modules that add subcommands: each defines register(subparsers) and sets `func` on its parsers.
COMMAND_MODULES = (
    "agent.cli.run_agent",
    "agent.cli.admin",
    "agent.cli.certs",
    "agent.cli.profile",
    "agent.cli.store",
)

PLUGIN_GROUP = "elasticmoe.cli"  # entry points: register(subparsers), called after the product's own commands


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emoe", description="ElasticMoE control plane")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for ep in entry_points(group=PLUGIN_GROUP):
        try:
            ep.load()(sub)
        except Exception as e:  # noqa: BLE001 - a broken plugin costs its commands, not the CLI
            print(f"emoe: commands from {ep.value} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
    return parser


# Exit status when stdout's reader went away (`emoe status --json | head -1`): 141 = 128 + SIGPIPE, what the
# shell reports for cat, seq or git cut off the same way, so `set -o pipefail` scripts already treat it as
# theirs. Not 0: the output was not all delivered; not 1: that means the command itself failed.
EXIT_CLOSED_PIPE = 141


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
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
