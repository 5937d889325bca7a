"""Fault injection for the real gRPC transport: partitions between agent processes on loopback.

The agents run through `python -m chaos.agentproc --faults FILE` (chaos.localcluster.LocalCluster with
`faults_file`), which hands `FaultFile(FILE, node).drops` to the gRPC transport as its drop hook; the product
has only that hook (agent.transport.grpc.GrpcTransport `drops`, None in production). The file is JSON,
rewritten atomically (write + rename) by the runner:

    {"drop": {"node1": ["node3", "node4"], "node3": ["node1"], ...}}

`drop[me]` lists the peers this node neither calls (the call fails at its deadline, as a lost request
does) nor answers (UNAVAILABLE). A partition is written as both directions. The file is re-read when its
(mtime, inode, size) changes, checked at most every `recheck_s`; a missing or malformed file drops nothing
(logged once), so a runner that removes it heals everything.

Used where namespaces with veth pairs and tc/iptables are unavailable (the issue allows "a fault-injecting
interceptor where namespaces are unavailable"); admin and shim-link traffic are never affected.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger("emoe.chaos.faults")

class FaultFile:
    """The peers `node_id` drops traffic to and from, read from `path` (see the module docstring)."""

    def __init__(self, path: str, node_id: str, recheck_s: float = 0.05) -> None:
        self.path, self.node_id, self.recheck_s = path, node_id, recheck_s
        self._key: tuple[int, int, int] | None = None
        self._next_check = 0.0
        self._drop: frozenset[str] = frozenset()
        self._warned = False

    def drops(self, peer: str) -> bool:
        """True when traffic between this node and `peer` is to be dropped now."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + self.recheck_s
            self._reload()
        return peer in self._drop

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._key, self._drop = None, frozenset()
            return
        key = (st.st_mtime_ns, st.st_ino, st.st_size)
        if key == self._key:
            return
        self._key = key
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            peers = doc.get("drop", {}).get(self.node_id, [])
            if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
                raise ValueError(f"drop.{self.node_id}: expected a list of node ids")
            self._drop = frozenset(peers)
        except (OSError, ValueError, AttributeError) as e:
            if not self._warned:
                log.warning("%s: fault file %s unreadable (%s): dropping nothing", self.node_id, self.path, e)
                self._warned = True
            self._drop = frozenset()


def write_faults(path: str, drop: dict[str, list[str]]) -> None:
    """Atomically replace the fault file (write a sibling, then rename over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"drop": drop}, f, sort_keys=True)
    os.replace(tmp, path)
