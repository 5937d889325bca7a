"""The harness's `emoe` subcommands (`bench`, `demo`, `trace import`, `load replay`), registered through the
`elasticmoe.cli` entry point group: the product's CLI loads whatever registers there and imports nothing
from the harness itself, so a product install without bench/ simply lacks these commands."""

from __future__ import annotations

import argparse

from bench import cli_bench, cli_demo, cli_load, cli_trace


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for mod in (cli_demo, cli_trace, cli_bench, cli_load):
        mod.register(sub)
