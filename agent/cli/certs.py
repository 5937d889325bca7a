"""`emoe certs`: a development CA and node/client certificates for mutual TLS (see agent/security.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agent.cli.argtypes import int_in


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "certs", help="create a development CA and node/client certificates for mutual TLS",
        description="Creates DIR/ca.pem (reusing an existing CA in DIR) and DIR/NAME.pem, DIR/NAME-key.pem "
                    "per node id and client identity. Point [tls] cert_dir at DIR; keep ca-key.pem off the "
                    "nodes.")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    p.add_argument("--nodes", required=True, type=_names, metavar="ID,ID,...",
                   help="node ids (the node_id of each agent's config)")
    p.add_argument("--clients", type=_names, default=["admin"], metavar="NAME,...",
                   help="client identities for the admin CLI (default: admin)")
    p.add_argument("--days", type=int_in(1, 36_500), default=365, help="validity in days, 1..36500 (default 365)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.security import TlsFilesError, write_dev_certs

    try:
        written = write_dev_certs(args.out, args.nodes, args.clients, args.days)
    except (ValueError, TlsFilesError) as e:
        print(f"emoe certs: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"emoe certs: {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0
