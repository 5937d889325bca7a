"""The etcd backend's head at the start of each session (agent/etcd/etcd_backend.py): brought up to this node's.

On a new cluster's etcd, `head` is created at the genesis version. On an etcd that lost versions this node
committed (wiped, or restored from an older backup), those versions go back from this node's commits, in the
transaction that moves `head` (compared on its value, each table key on its absence): a node that starts at
genesis, or lags, then follows them and cannot commit a second table for a version the cluster committed.
Where etcd holds another table for a version this node committed (a node at genesis committed on the wiped
etcd before any node with the history came back), the histories diverged: `EtcdDiverged` names the version and
what an operator can do; the backend then proposes and installs nothing from etcd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import aetcd

from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)


class EtcdDiverged(Exception):
    """etcd holds another table (or none) for a version this node committed, or a head that is not a version."""


async def seed_head(client: aetcd.Client, head_key: bytes, table_key: Callable[[int], bytes], genesis: int,
                    mine: int, commits: Mapping[int, pb.Commit], endpoint: str) -> None:
    """Make etcd's head at least `mine` (this node's head), writing back the versions above etcd's head that
    this node holds in `commits`. Raises EtcdDiverged (module docstring); ConnectionError when other nodes keep
    moving the head while this one writes."""
    tx = client.transactions
    for _ in range(16):  # each retry follows a head another node moved; they stop once it reaches ours
        got = await client.get(head_key)
        h = _version(got.value, endpoint) if got is not None else None
        if h is not None:
            await _same_table(client, table_key, genesis, min(h, mine), commits, mine, endpoint)  # one history
            if h >= mine:
                return
        base = genesis if h is None else h
        ours = [v for v in range(base + 1, mine + 1) if v in commits]
        compare = [tx.create(head_key) == 0] if h is None else [tx.value(head_key) == str(h).encode()]
        compare += [tx.create(table_key(v)) == 0 for v in ours]
        puts = [tx.put(table_key(v), commits[v].SerializeToString()) for v in ours]
        ok, _ = await client.transaction(compare=compare, success=[tx.put(head_key, str(mine).encode()), *puts],
                                         failure=[])
        if ok:
            if mine > base:
                gap = "" if ours and ours[0] == base + 1 else (
                    f"; versions {base + 1}..{(ours[0] if ours else mine + 1) - 1} are no longer in this node's "
                    f"store (compacted): a node behind them cannot catch up from etcd")
                log.warning("etcd at %s held %s, below version %d that this node committed (etcd wiped, or "
                            "restored from an older backup): wrote back versions %s from this node's store%s",
                            endpoint, "no head" if h is None else f"version {h}", mine,
                            f"{ours[0]}..{ours[-1]}" if ours else "none", gap)
            return
    raise ConnectionError(f"etcd at {endpoint}: its head kept moving while this node wrote back its versions")


async def _same_table(client: aetcd.Client, table_key: Callable[[int], bytes], genesis: int, v: int,
                      commits: Mapping[int, pb.Commit], mine: int, endpoint: str) -> None:
    """Raise EtcdDiverged when etcd's table of version v is not the one this node committed."""
    ours = commits.get(v)
    if ours is None or v <= genesis:
        return
    kv = await client.get(table_key(v))
    theirs = pb.Commit.FromString(kv.value) if kv is not None else None
    if theirs is None or theirs.qc.table_hash != ours.qc.table_hash:
        raise EtcdDiverged(
            f"etcd at {endpoint} holds {'no table' if theirs is None else 'another table'} for version {v}, "
            f"which this node committed ({ours.qc.table_hash.hex()[:12]}): etcd lost history and "
            f"{'' if theirs is None else 'another node committed over it; '}this node proposes and installs "
            f"nothing from it. Restore etcd from a backup at or past version {mine}, or wipe this node's "
            f"data_dir to follow etcd")


def _version(raw: bytes, endpoint: str) -> int:
    try:
        return int(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise EtcdDiverged(f"etcd at {endpoint}: its head key holds {raw[:40]!r}, not a version") from None
