"""The pause switch on the etcd backend: the same records as the quorum's (agent/consensus/control.py), kept in
one key beside the tables, `/emoe/<cluster>/control`, holding the newest consensus_pb2.ControlCommit.

A write is one transaction `compare(mod_revision(control) == the revision read) -> put(control, record)` whose
record's seq is one above the one it read (`create_revision == 0` for the first), so concurrent writes are
ordered by etcd: one wins, the other reads again and goes above it. Its certificate names the etcd cluster as
its one voter, as an etcd commit's does. Every node reads the key every `poll_s` (and after its own writes)
and keeps the newest record in its local store before it adopts it, so a restart knows the switch before etcd
answers.

Who may write: etcd's own access control decides it (its client certificates and roles); the key holds no
per-agent signatures, so an agent that can write `/emoe/<cluster>/` can write any record there, under any
`node_id` or `admin`. The quorum backend's writer check (control.py, Writer) has no counterpart here: give
only the agents write access to the cluster's prefix. A record names the admin who asked (`admin`) as the
quorum's do. `refused` counts the values read from the key that do not decode or check, by ControlRefusal.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aetcd

from agent.consensus.control import MAX_ADMIN, MAX_NOTE, check_commit, describe, key
from agent.consensus.controlnode import ControlCallback, ControlOutcome
from agent.etcd.etcd_backend import ETCD_VOTER
from agent.storage.store import Store, StoreFailed
from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)
POLL_S = 1.0  # how often every node reads the switch: a pause reaches every planner within about a second


class EtcdPause:
    """`client()`: the etcd backend's connected client (None while it is not connected); `control_key`: the
    switch's key; `store`: this node's local log (the backend opened it)."""

    def __init__(self, client: Callable[[], aetcd.Client | None], control_key: bytes, node_id: str,
                 store: Store | None, *, poll_s: float = POLL_S, attempts: int = 4) -> None:
        self.client, self.control_key, self.node_id, self.store = client, control_key, node_id, store
        self.poll_s, self.attempts = poll_s, attempts
        self._record: pb.ControlCommit | None = None
        self._callbacks: list[ControlCallback] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.running = False
        self.refused: dict[str, int] = {}  # values of the key refused, by ControlRefusal name

    def start(self) -> None:
        """Adopt the record the local store holds, then follow etcd's."""
        st = self.store.control if self.store is not None else None
        if st is not None and st.HasField("certified"):
            self._record = st.certified
        self.running = True
        self._spawn(self._poll())

    def stop(self) -> None:
        self.running = False
        for t in list(self._tasks):
            t.cancel()

    @property
    def record(self) -> pb.ControlCommit | None:
        return self._record

    def on_change(self, cb: ControlCallback) -> None:
        self._callbacks.append(cb)

    def unready(self) -> str:
        return "" if self.client() is not None else "not connected to etcd"

    def write(self, paused: bool, note: str, on_done: Callable[[ControlOutcome], None], admin: str = "") -> None:
        async def run() -> None:
            on_done(await self.write_async(paused, note, admin))

        self._spawn(run())

    async def write_async(self, paused: bool, note: str, admin: str = "") -> ControlOutcome:
        why = ""
        for _ in range(self.attempts):
            client = self.client()
            if client is None:
                return ControlOutcome(False, None, "UNAVAILABLE: not connected to etcd")
            tx = client.transactions
            try:
                kv = await client.get(self.control_key)
                old = self._adopt(kv.value) if kv is not None else None
                r = pb.ControlRecord(seq=(old.record.seq if old is not None else 0) + 1, node_id=self.node_id,
                                     paused=paused, at_ms=int(time.time() * 1000), note=note[:MAX_NOTE],
                                     admin=admin[:MAX_ADMIN])
                c = pb.ControlCommit(record=r, voters=[ETCD_VOTER], quorum=1)
                same = (tx.mod(self.control_key) == kv.mod_revision if kv is not None
                        else tx.create(self.control_key) == 0)
                won, _ = await client.transaction(compare=[same], success=[tx.put(self.control_key,
                                                                                  c.SerializeToString())], failure=[])
            except Exception as e:  # IO failure: absorbed and reported as the outcome
                return ControlOutcome(False, None, f"etcd transaction failed: {type(e).__name__}: {e}")
            if won:
                self._adopt(c.SerializeToString())
                return ControlOutcome(True, c)
            why = "another node wrote the switch at the same time"
        return ControlOutcome(False, None, f"not committed after {self.attempts} attempts: {why}")

    def _refuse(self, code: pb.ControlRefusal) -> None:
        name = pb.ControlRefusal.Name(code)
        self.refused[name] = self.refused.get(name, 0) + 1

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _poll(self) -> None:
        while self.running:
            client = self.client()
            if client is not None:
                try:
                    kv = await client.get(self.control_key)
                    if kv is not None:
                        self._adopt(kv.value)
                except Exception:  # etcd away: the backend reconnects; the switch is read again next time
                    log.debug("reading the pause switch from etcd failed", exc_info=True)
            await asyncio.sleep(self.poll_s)

    def _adopt(self, raw: bytes) -> pb.ControlCommit | None:
        """The record etcd holds (`raw`), made durable here and adopted if it is newer than ours; None if it does
        not decode or check."""
        try:
            c: pb.ControlCommit = pb.ControlCommit.FromString(raw)
        except Exception:  # noqa: BLE001 - a value that does not decode is reported, not raised
            log.error("etcd key %r does not hold a control record", self.control_key)
            self._refuse(pb.CONTROL_MALFORMED)
            return None
        why = check_commit(c, [ETCD_VOTER])
        if why:
            log.error("etcd key %r: %s", self.control_key, why)
            self._refuse(pb.CONTROL_BAD_COMMIT)
            return None
        if key(c.record) > key(self._record.record if self._record is not None else None):
            if self.store is not None:
                try:  # durable here before it is adopted: a restart knows it without etcd
                    self.store.save_control(pb.ControlState(certified=c))
                except StoreFailed:
                    return c  # adopted at the next read, once the disk takes it
            self._record = c
            log.info("%s: cluster switch: %s", self.node_id, describe(c))
            for cb in self._callbacks:
                cb(c)
        return c
