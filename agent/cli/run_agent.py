"""`emoe agent`: run (or just validate the config of) one node's agent.

Before the agent starts, and with `--check`, the config is also checked against this host (`preflight`): the
engine side can build its genesis (cluster.genesis: a placement file is read here), the data_dir can be
created and written, the TLS files are there and name this node, and a plaintext agent
listens only on loopback unless the config says `[tls] insecure = true`. Every problem is one line naming
the field and the value; nothing here prints a traceback for a bad config.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from agent.config import AgentConfig, ConfigError, is_loopback


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="run the per-node agent")
    p.add_argument("--config", required=True, help="TOML config file")
    p.add_argument("--check", action="store_true",
                   help="validate the config against this host (data_dir, TLS files, exposure) and exit")
    p.set_defaults(func=run)


def check_data_dir(data_dir: str) -> None:
    """Raises ConfigError unless `data_dir` exists as a writable directory or can be created. Tries it, and
    leaves nothing behind: a scratch file in the directory, or a scratch directory in its nearest existing
    ancestor when it does not exist yet (created the same way the agent will)."""
    path = Path(data_dir).absolute()
    where = path
    while not where.exists():
        if where.is_symlink():  # a dangling link: mkdir would fail on it
            raise ConfigError(f"data_dir = {data_dir!r}: {where} is a broken symbolic link")
        where = where.parent
    if not where.is_dir():
        raise ConfigError(f"data_dir = {data_dir!r}: {where} is not a directory")
    try:
        if where == path:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".emoe-check-"):
                pass
        else:
            os.rmdir(tempfile.mkdtemp(dir=where, prefix=".emoe-check-"))
    except OSError as e:
        what = "written" if where == path else f"created (cannot create entries in {where})"
        raise ConfigError(f"data_dir = {data_dir!r}: cannot be {what}: {e.strerror or e}") from None


def check_tls_files(cfg: AgentConfig) -> None:
    """Raises ConfigError unless tls.cert_dir holds the CA and this node's certificate and key, readable, and
    the certificate is issued to node_id (its CN: peers check the name)."""
    from agent.security import TlsFilesError, identity_files

    d = cfg.tls.cert_dir
    if not Path(d).is_dir():
        raise ConfigError(f"tls.cert_dir = {d!r}: no such directory; create it with `emoe certs`")
    try:
        _, cert, _ = identity_files(d, cfg.node_id)
    except TlsFilesError as e:
        raise ConfigError(f"tls.cert_dir = {d!r}: {e}") from None
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    try:
        cns = x509.load_pem_x509_certificate(cert).subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    except ValueError as e:
        raise ConfigError(f"tls.cert_dir = {d!r}: {cfg.node_id}.pem is not a PEM certificate: {e}") from None
    names = [str(a.value) for a in cns]
    if names != [cfg.node_id]:
        raise ConfigError(f"tls.cert_dir = {d!r}: {cfg.node_id}.pem is issued to {names}, not to node_id "
                          f"{cfg.node_id!r}; peers would refuse it")


def check_exposure(cfg: AgentConfig) -> list[str]:
    """Raises ConfigError for plaintext on a non-loopback `listen` unless tls.insecure; returns the warning
    to print at every start when it is allowed that way."""
    if cfg.tls.cert_dir or is_loopback(cfg.listen):
        return []
    if not cfg.tls.insecure:
        raise ConfigError(
            f"listen = {cfg.listen!r}: plaintext on a non-loopback address (tls.cert_dir is empty): anyone who "
            f"reaches the port could join, vote and drain ranks; set tls.cert_dir (see `emoe certs`), listen on "
            f"127.0.0.1, or, on an isolated network only, set tls.insecure = true")
    return [f"listen = {cfg.listen!r} in plaintext (tls.insecure = true): any host that reaches this port can "
            f"join the cluster, vote, and drain, restore, pause or resume it"]


def preflight(cfg: AgentConfig) -> list[str]:
    """The host-dependent checks `emoe agent` runs before starting (and with --check). Raises ConfigError
    naming the field; returns warnings."""
    from agent.state import rank_order_warning

    warnings = check_exposure(cfg) + [w for w in [rank_order_warning(cfg)] if w]
    check_data_dir(cfg.data_dir)
    if cfg.tls.cert_dir:
        check_tls_files(cfg)
    return warnings


def run(args: argparse.Namespace) -> int:
    from agent.state import load_checked

    try:
        cfg = load_checked(args.config)  # the genesis too: the engine's boot placement, a name or a file of this shape
    except ConfigError as e:
        print(f"emoe agent: invalid config: {e}", file=sys.stderr)
        return 2
    try:
        warnings = preflight(cfg)
    except ConfigError as e:
        print(f"emoe agent: invalid config: {args.config}: {e}", file=sys.stderr)
        return 2
    for w in warnings:
        print(f"emoe agent: warning: {w}", file=sys.stderr, flush=True)
    if args.check:
        print(f"{args.config}: ok (node {cfg.node_id}, profile {cfg.profile}, listen {cfg.listen})")
        return 0
    from agent.process import run_forever

    return run_forever(cfg)
