"""The etcd commit backend: the same propose/commit interface as ConsensusNode, with etcd's Raft as the quorum.

Keys under `/emoe/<cluster>/`:
- `head`              the committed table version, decimal;
- `tables/<v:020d>`   the consensus_pb2.Commit of version v (its table, plan, proposer);
- `members/<node>`    the node's address, attached to a lease: seed discovery that forgets dead nodes;
- `control`           the pause switch's newest record, a consensus_pb2.ControlCommit (agent/etcd/etcd_pause.py).

A commit is one transaction `compare(value(head) == v) -> put(head, v + 1), put(tables/v+1, commit)`, so at
most one table is ever written for a version (I1) and versions follow their parents (I2). Every node
watches `tables/` and installs commits in version order, writing each to its local Store first when it has
one (commit before install). The certificate of an etcd commit names the etcd cluster as its only voter:
its quorum is etcd's own.

Each session starts by bringing etcd's `head` up to this node's (agent/etcd/etcd_seed.py): an etcd that lost versions
this node committed gets them back, and one that committed another table over them is refused by name.

etcd may be down when the agent starts, or go away while it runs: the backend connects in the background and
reconnects for as long as it runs, each failed attempt logged at WARNING with the endpoints and the next
delay. Until it is connected and has read the commits it missed, `failure` says why, so the agent reports
NOT_SERVING (gRPC health, `emoe status`) and proposes nothing; once caught up it serves again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import aetcd
from aetcd.utils import prefix_range_end

from agent.consensus.node import CommitCallback, Outcome, Verifier, validity_verifier
from agent.etcd.etcd_seed import EtcdDiverged, seed_head
from agent.storage.store import Store, StoreFailed
from controlplane.table import RoutingTable
from elasticmoe.codec import TableWireError, table_from_pb, table_to_pb
from elasticmoe.v1 import consensus_pb2 as pb

log = logging.getLogger(__name__)
ETCD_VOTER = "etcd"

# Reconnection backoff: the first retry after half a second (an etcd restarted in place answers again within
# about that), doubling up to 5 s, so that an agent started before etcd, or cut off from it, serves within
# 5 s of etcd answering while a down etcd costs each agent one attempt per endpoint every 5 s.
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0
# While connected, one Status call every 2 s: a watch on a network that was cut without a FIN or RST waits
# for ever, and a failed probe ends the session (the backend reconnects) within 2 s plus the call's timeout.
PROBE_EVERY_S = 2.0


def parse_endpoint(ep: str) -> tuple[str, int]:
    host, sep, port = ep.removeprefix("http://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {ep!r}: expected 'host:port'")
    return host, int(port)


class EtcdBackend:
    def __init__(self, endpoints: list[str], node_id: str, head: RoutingTable, *, cluster: str = "emoe",
                 store: Store | None = None, verifier: Verifier = validity_verifier, timeout: float = 5.0,
                 gate: Callable[[], str] | None = None) -> None:
        if not endpoints:
            raise ValueError("endpoints is empty: expected at least one etcd 'host:port'")
        self.endpoints = [parse_endpoint(e) for e in endpoints]
        self.node_id = node_id
        self.verifier = verifier
        self.gate = gate or (lambda: "")  # why this node must not propose beyond its store (agent.fingerprint)
        self.timeout = timeout
        self.store = store
        self._prefix = f"/emoe/{cluster}/".encode()
        self._head = head
        self._genesis = head.version
        self._commits: dict[int, pb.Commit] = {}
        self._future: dict[int, pb.Commit] = {}
        self._callbacks: list[CommitCallback] = []
        self._client: aetcd.Client | None = None  # while connected and caught up: proposals use it
        self._conn: aetcd.Client | None = None    # the connection of the current session, caught up or not
        self._unreachable = "not connected to etcd yet"  # why there is no session ("" while there is one)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ready = asyncio.Event()  # set while connected and caught up
        self._lease: Any = None
        self._registration: tuple[str, int] | None = None  # (address, ttl) once register() was called
        self.running = False

    # ---- keys ---------------------------------------------------------------------------------------
    def _key(self, *parts: str) -> bytes:
        return self._prefix + "/".join(parts).encode()

    def _table_key(self, v: int) -> bytes:
        return self._key("tables", f"{v:020d}")

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect, seed the genesis head, load and watch the committed tables (in the background)."""
        if self.store is not None:
            for c in self.store.open().commits:
                self._adopt(c, persist=False)
            self.store.settle_loss()  # a cut local log votes on nothing here: etcd holds the history
        self.running = True
        self._spawn(self._run())

    async def ready(self) -> None:
        """Return once connected and caught up; TimeoutError after `timeout` seconds."""
        await asyncio.wait_for(self._ready.wait(), self.timeout)

    @property
    def connected(self) -> bool:
        return self._client is not None

    def stop(self) -> None:
        self.running = False
        for t in list(self._tasks):
            t.cancel()
        if self.store is not None:
            self.store.close()

    async def close(self) -> None:
        self.stop()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        conn, self._conn, self._client = self._conn, None, None
        if conn is not None:
            if self._lease is not None:
                try:
                    await asyncio.wait_for(self._lease.revoke(), self.timeout)
                except Exception:  # the lease expires on its own
                    log.debug("lease revoke failed", exc_info=True)
            await _close_quietly(conn, self.timeout)

    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._done)

    def _done(self, t: asyncio.Task[Any]) -> None:
        self._tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:  # a bug: IO failures are absorbed where they happen
            log.error("etcd backend task failed", exc_info=t.exception())

    async def _connect(self) -> tuple[aetcd.Client, str]:
        """A client that answered a Status call, and its endpoint; ConnectionError naming every endpoint's error."""
        errors: list[str] = []
        for host, port in self.endpoints:
            c = aetcd.Client(host=host, port=port, timeout=int(self.timeout) or 1)
            try:
                await c.connect()
                await asyncio.wait_for(c.status(), self.timeout)
                return c, f"{host}:{port}"
            except Exception as e:  # try the next endpoint
                errors.append(f"{host}:{port}: {_why(e)}")
                await _close_quietly(c, self.timeout)
            except asyncio.CancelledError:  # stop() while connecting: no channel left behind
                await _close_quietly(c, self.timeout)
                raise
        raise ConnectionError(f"no etcd endpoint reachable ({'; '.join(errors)})")

    async def _run(self) -> None:
        """Connect, follow etcd until the connection is lost, reconnect; for as long as the backend runs."""
        delay = RETRY_FIRST_S
        while self.running:
            try:
                client, endpoint = await self._connect()
            except ConnectionError as e:
                self._unreachable = str(e)
                log.warning("%s; retrying in %.1f s", e, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            self._conn = client
            try:
                await self._session(client, endpoint)
                why = "the watch ended"
            except asyncio.CancelledError:
                raise  # stop(): close() closes the connection (after revoking the lease)
            except EtcdDiverged as e:  # nothing a reconnect fixes: said once, checked again slowly
                self._client, self._conn = None, None
                self._ready.clear()
                if str(e) != self._unreachable:
                    log.error("%s", e)
                self._unreachable = str(e)
                await _close_quietly(client, self.timeout)
                await asyncio.sleep(RETRY_MAX_S)
                continue
            except Exception as e:  # IO failure: absorbed; the backend reconnects
                why = _why(e)
            self._client, self._conn = None, None
            self._ready.clear()
            self._unreachable = f"lost the connection to etcd at {endpoint}: {why}"
            await _close_quietly(client, self.timeout)
            delay = RETRY_FIRST_S
            log.warning("%s; reconnecting in %.1f s", self._unreachable, delay)
            await asyncio.sleep(delay)

    async def _session(self, client: aetcd.Client, endpoint: str) -> None:
        """Seed the head, read the commits this node lacks, then follow the watch until the connection fails."""
        await seed_head(client, self._key("head"), self._table_key, self._genesis, self._head.version, self._commits,
                        endpoint)
        tables = self._key("tables/")
        rng = await client.get_range(self._table_key(self._head.version + 1), prefix_range_end(tables))
        rev = rng.header.revision if rng.header is not None else 0
        for kv in sorted(rng, key=lambda kv: kv.key):
            self._adopt(pb.Commit.FromString(kv.value))
        watch = await client.watch_prefix(tables, start_revision=rev + 1)
        self._client, self._unreachable = client, ""
        self._ready.set()
        log.info("etcd: connected to %s, at version %d", endpoint, self._head.version)
        if self._registration is not None:
            await self._put_member(client, *self._registration)
        follow = asyncio.ensure_future(self._follow(watch))
        probe = asyncio.ensure_future(self._probe(client))
        try:
            done, _ = await asyncio.wait({follow, probe}, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # raises what ended the session
        finally:
            for t in (follow, probe):
                t.cancel()
            await asyncio.gather(follow, probe, return_exceptions=True)

    async def _follow(self, watch: Any) -> None:
        async for ev in watch:
            if not self.running:
                break
            if ev.kind == "PUT":
                self._adopt(pb.Commit.FromString(ev.kv.value))

    async def _probe(self, client: aetcd.Client) -> None:
        while True:
            await asyncio.sleep(PROBE_EVERY_S)
            await asyncio.wait_for(client.status(), self.timeout)

    # ---- the ConsensusNode interface -----------------------------------------------------------------
    @property
    def failure(self) -> str:
        """Why commits are held back here: a failed local store, or no connection to etcd ("" while neither)."""
        store = self.store.failure if self.store is not None else ""
        return store or ("" if self._client is not None else self._unreachable)

    @property
    def abstains(self) -> str:
        """Why this node may not propose now (agent.commit.CommitBackend.abstains): its local store failed, or its
        gate says so (a config whose cluster fingerprint differs from the voters')."""
        return self.failure or self.gate()

    @property
    def head(self) -> RoutingTable:
        return self._head

    @property
    def role(self) -> str:
        return "etcd client"

    def peer_heads(self) -> dict[str, int]:
        """Only this node's: etcd holds the history, and nodes do not tell each other their heads."""
        return {self.node_id: self._head.version}

    def committed(self, version: int) -> pb.Commit | None:
        return self._commits.get(version)

    def commits_since(self, version: int) -> list[pb.Commit]:
        return [self._commits[v] for v in sorted(self._commits) if v > version]

    def on_commit(self, cb: CommitCallback) -> None:
        self._callbacks.append(cb)

    def catch_up(self, peer: str) -> None:
        """Nothing to do: the watch on etcd delivers every commit."""

    def propose(self, table: RoutingTable, plan: pb.Plan, on_done: Callable[[Outcome], None]) -> None:
        self._spawn(self.propose_async(table, plan, on_done))

    async def propose_async(self, table: RoutingTable, plan: pb.Plan,
                            on_done: Callable[[Outcome], None] | None = None) -> Outcome:
        t0 = time.perf_counter()
        out = await self._try_commit(table, plan, t0)
        if on_done is not None:
            on_done(out)
        return out

    async def _try_commit(self, table: RoutingTable, plan: pb.Plan, t0: float) -> Outcome:
        v = table.version
        if table.parent != v - 1 or v != self._head.version + 1:
            return Outcome(False, v, f"table version {v} parent {table.parent}: expected version "
                                     f"{self._head.version + 1} parent {self._head.version}")
        if self.abstains:
            return Outcome(False, v, f"UNAVAILABLE: {self.abstains}")
        ok, gain, why = self.verifier(self._head, table, plan)
        if not ok:
            return Outcome(False, v, f"own check: {why}")
        if self._client is None:
            return Outcome(False, v, f"not connected to etcd: {self._unreachable}")
        vote = pb.Vote(voter=self.node_id, accept=True, verified_gain=gain)
        tpb = table_to_pb(table)
        qc = pb.QuorumCertificate(version=v, ballot=pb.Ballot(round=0, node_id=ETCD_VOTER), table_hash=tpb.content_hash,
                                  voters=[ETCD_VOTER], quorum=1)
        commit = pb.Commit(table=tpb, qc=qc, plan=plan, votes=[vote], proposer=self.node_id,
                           committed_at_ms=int(time.time() * 1000))
        tx = self._client.transactions
        head_key = self._key("head")
        try:
            won, _ = await self._client.transaction(
                compare=[tx.value(head_key) == str(v - 1).encode()],
                success=[tx.put(head_key, str(v).encode()), tx.put(self._table_key(v), commit.SerializeToString())],
                failure=[tx.get(head_key)],
            )
        except Exception as e:  # IO failure: absorbed and reported as the outcome
            return Outcome(False, v, f"etcd transaction failed: {type(e).__name__}: {e}", [vote],
                           time.perf_counter() - t0)
        if not won:
            return Outcome(False, v, f"etcd head moved past {v - 1}: version {v} committed another table",
                           [], time.perf_counter() - t0)
        self._adopt(commit)  # the watch delivers it too; installing now is what makes the latency one RTT
        return Outcome(True, v, "", [vote], time.perf_counter() - t0, commit)

    def _adopt(self, c: pb.Commit, persist: bool = True) -> None:
        """Install a commit read from etcd (or the local store) if it extends the head; buffer it if early."""
        v = int(c.table.version)
        have = self._commits.get(v)
        if have is not None:
            if have.qc.table_hash != c.qc.table_hash:
                log.error("I1 broken: etcd holds two tables for version %d", v)
            return
        if v <= self._head.version:
            return
        if v != self._head.version + 1:
            self._future[v] = c
            return
        try:
            table = table_from_pb(c.table, self._head.topology)
        except TableWireError as e:
            log.error("etcd commit %d unreadable: %s", v, e)
            return
        if persist and self.store is not None:
            try:  # commit (durably, here) before install; a failed disk holds it back until the disk works
                if self.store.failed and not self.store.resume():
                    raise StoreFailed(self.store.failed)
                self.store.append_commit(c)
            except StoreFailed:
                self._future[v] = c  # retried with the next commit etcd reports
                return
        self._commits[v] = c
        self._head = table
        for cb in self._callbacks:
            cb(c, table)
        nxt = self._future.pop(v + 1, None)
        if nxt is not None:
            self._adopt(nxt)

    # ---- the pause switch's key beside the tables (agent/etcd/etcd_pause.py) -----------------------------------
    @property
    def client(self) -> aetcd.Client | None:
        """The connected etcd client (None while not connected)."""
        return self.connected_client()

    def connected_client(self) -> aetcd.Client | None:
        """`client` as a call: what the pause switch (agent.etcd.etcd_pause.EtcdPause) asks before each write."""
        return self._client

    def control_key(self) -> bytes:
        return self._key("control")

    # ---- seed discovery -------------------------------------------------------------------------------
    async def register(self, address: str, ttl: int = 5) -> None:
        """Announce `node_id -> address` under a lease kept alive while this backend runs (renewed after a
        reconnection). ConnectionError when etcd is not reachable within `timeout`."""
        self._registration = (address, ttl)
        try:
            await self.ready()
        except TimeoutError:
            raise ConnectionError(f"not connected to etcd: {self._unreachable}") from None
        if self._client is None:
            raise ConnectionError(f"not connected to etcd: {self._unreachable}")
        await self._put_member(self._client, address, ttl)

        async def keepalive() -> None:
            while self.running:
                await asyncio.sleep(max(0.2, ttl / 3))
                if self._client is None or self._lease is None:
                    continue  # the next session registers again
                try:
                    await self._lease.refresh()
                except Exception as e:  # the session's probe notices a lost etcd
                    log.debug("etcd lease refresh failed: %s", _why(e))

        self._spawn(keepalive())

    async def _put_member(self, client: aetcd.Client, address: str, ttl: int) -> None:
        self._lease = await client.lease(ttl)
        await client.put(self._key("members", self.node_id), address.encode(), lease=self._lease)

    async def members(self) -> dict[str, str]:
        """Live registered nodes: node_id -> address."""
        try:
            await self.ready()
        except TimeoutError:
            raise ConnectionError(f"not connected to etcd: {self._unreachable}") from None
        if self._client is None:
            raise ConnectionError("not connected to etcd")
        rng = await self._client.get_prefix(self._key("members/"))
        n = len(self._key("members/"))
        return {kv.key[n:].decode(): kv.value.decode() for kv in rng}


def _why(e: BaseException) -> str:
    """One line for an IO error (no traceback): aetcd's errors carry gRPC's details as their text."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def _close_quietly(client: aetcd.Client, timeout: float) -> None:
    try:
        await asyncio.wait_for(client.close(), timeout)
    except Exception:  # a connection that failed may fail to close too; its channel is dropped either way
        log.debug("etcd client close failed", exc_info=True)
