"""`emoe`: the ElasticMoE command line. Each subcommand lives in its own module with a `register`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Modules that add subcommands: each defines register(subparsers) and sets `func` on its parsers.
COMMAND_MODULES = (
    "agent.cli.run_agent",
    "agent.cli.admin",
    "agent.cli.demo",
    "agent.cli.tools",
    "agent.cli.certs",
    "agent.cli.bench",
    "agent.cli.profile",
    "agent.cli.store",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="emoe", description="ElasticMoE control plane")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
