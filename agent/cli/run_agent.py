"""`emoe agent`: run (or just validate the config of) one node's agent."""

from __future__ import annotations

import argparse
import sys

from agent.config import ConfigError, load


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run the per-node agent")
    p.add_argument("--config", required=True, help="TOML config file")
    p.add_argument("--check", action="store_true", help="validate the config and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"emoe agent: invalid config: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok (node {cfg.node_id}, profile {cfg.profile}, listen {cfg.listen})")
        return 0
    from agent.node import run_forever

    return run_forever(cfg)
