"""`emoe store`: check or repair a stopped agent's consensus log.

`check` reads the log the way a starting agent does and says what it holds, where a torn tail would be
cut, or at which offset it is corrupt. `repair` moves a corrupt (or lost) log aside, never deleting it: at
its next start the node rebuilds from its peers as a learner and votes again only once it has caught up
past every version it might have voted on before.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.config import ConfigError
from agent.storage.datadir import LOG_NAME


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("store", help="check or repair a stopped agent's consensus log")
    ssub = p.add_subparsers(dest="store_command", metavar="ACTION", required=True)
    for name, fn, text in (("check", check, "read the log as a starting agent would and report"),
                           ("repair", repair, "move a corrupt log aside; the node rebuilds from its peers")):
        q = ssub.add_parser(name, help=text)
        q.add_argument("--config", required=True, help="the agent's TOML config file")
        q.set_defaults(func=fn)


def _data_dir(path: str) -> Path | None:
    try:
        from agent.state import load_checked

        return Path(load_checked(path).data_dir)
    except ConfigError as e:
        print(f"emoe store: invalid config: {e}", file=sys.stderr)
        return None


def check(args: argparse.Namespace) -> int:
    from agent.storage.store import corrupt_where, high_water, parse, torn_tail

    d = _data_dir(args.config)
    if d is None:
        return 2
    log_path = d / LOG_NAME
    if not log_path.exists():
        print(f"{log_path}: no log (a new node, or one whose log was moved aside)")
        return 0
    data = log_path.read_bytes()
    rec, end = parse(data)
    versions = [int(c.table.version) for c in rec.commits]
    span = f"versions {versions[0]}..{versions[-1]}" if versions else "no commits"
    print(f"{log_path}: {len(data)} bytes, {rec.records} whole records ({span}, acceptor state for "
          f"{len(rec.acceptor)} versions)")
    if rec.newer:
        print(f"newer: {rec.newer} at offset {rec.bad_offset}: written by a newer release; the agent refuses to "
              f"start (run the newer release, or repair to rebuild the node from its peers)", file=sys.stderr)
        return 1
    torn = end < len(data) and torn_tail(data, rec)
    if end < len(data) and not torn:
        print(f"corrupt: bad record at offset {rec.bad_offset} ({rec.bad_reason}), "
              f"{corrupt_where(data, rec.bad_offset)}; the agent refuses to start. Repair: emoe store repair "
              f"--config {args.config}", file=sys.stderr)
        return 1
    if torn:
        print(f"torn tail: {len(data) - end} bytes at offset {end} ({rec.bad_reason}); the agent truncates it at "
              f"start (a write a crash cut short, never acknowledged)")
    high = high_water(log_path)
    if high is not None and high > end:
        print(f"cut: the log ends at byte {end} but had reached byte {high} ({high - end} bytes of acknowledged "
              f"records missing); the agent rebuilds this node from its peers as a learner at its next start",
              file=sys.stderr)
        return 1
    if not torn:
        print("ok")
    return 0


def repair(args: argparse.Namespace) -> int:
    from agent.storage.datadir import DataDirError
    from agent.storage.datadir import repair as move_aside

    d = _data_dir(args.config)
    if d is None:
        return 2
    try:
        aside = move_aside(d)
    except DataDirError as e:  # held by a running agent, or unusable: refused (agent.cli.exits)
        print(f"emoe store repair: {e}", file=sys.stderr)
        return 1
    if aside is None:
        print(f"{d / LOG_NAME}: no log to move aside; the node rebuilds from its peers at its next start")
    else:
        print(f"moved the log to {aside} (kept for inspection); at its next start the node rebuilds from its peers "
              f"as a learner")
    return 0
