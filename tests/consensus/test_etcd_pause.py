"""The pause switch on the etcd backend (agent/etcd/etcd_pause.py) against a real etcd server (skipped without the
binary): a write is learned by every node, concurrent writes are ordered by etcd's transaction (one after the
other, each seq one above the record it replaced), the record outlives a restart in the local store, and a
node without etcd says so."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.consensus.controlnode import ControlOutcome
from agent.etcd.etcd_backend import EtcdBackend
from agent.etcd.etcd_pause import EtcdPause
from agent.storage.store import Store
from chaos.etcdserver import EtcdProcess
from controlplane.table import initial_table
from controlplane.topology import Topology


def _node(etcd: str, name: str, store: Store | None) -> tuple[EtcdBackend, EtcdPause]:
    b = EtcdBackend([etcd], name, initial_table(Topology(2, 2, 4), 2, 8), cluster="pause", store=store)
    b.start()
    p = EtcdPause(lambda: b.client, b.control_key(), name, store, poll_s=0.05)
    p.start()
    return b, p


async def _until(pred: object, limit: float = 5.0) -> None:
    for _ in range(int(limit / 0.02)):
        if pred():  # type: ignore[operator]
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"not within {limit} s")


@pytest.mark.asyncio
async def test_the_switch_is_learned_ordered_and_kept(etcd_server: EtcdProcess, tmp_path: Path) -> None:
    ep = etcd_server.endpoint
    (a, pa), (b, pb_) = _node(ep, "a", Store(tmp_path / "a.log")), _node(ep, "b", None)
    try:
        await a.ready()
        await b.ready()
        o = await pa.write_async(True, "emoe pause")
        assert o.committed and o.commit is not None and o.commit.record.seq == 1 and list(o.commit.voters) == ["etcd"]
        await _until(lambda: pb_.record is not None and pb_.record.record.paused)
        outs: list[ControlOutcome] = list(await asyncio.gather(pa.write_async(False, "r"), pb_.write_async(True, "p")))
        assert all(x.committed for x in outs), [x.reason for x in outs]
        seqs = sorted(int(x.commit.record.seq) for x in outs if x.commit is not None)
        assert seqs == [2, 3]  # one after the other, each above the record it replaced
        last = next(x.commit for x in outs if x.commit is not None and x.commit.record.seq == 3)
        await _until(lambda: pa.record == last and pb_.record == last)
    finally:
        for p in (pa, pb_):
            p.stop()
        await a.close()
        await b.close()
    # restarted where etcd cannot be reached: the local store still knows the switch, and a write says why not
    again = Store(tmp_path / "a.log")
    c = EtcdBackend(["127.0.0.1:1"], "a", initial_table(Topology(2, 2, 4), 2, 8), cluster="pause", store=again,
                    timeout=0.5)
    c.start()
    pc = EtcdPause(lambda: c.client, c.control_key(), "a", again)
    pc.start()
    try:
        assert pc.record == last
        out = await pc.write_async(False, "resume")
        assert not out.committed and "not connected to etcd" in out.reason
    finally:
        pc.stop()
        await c.close()
