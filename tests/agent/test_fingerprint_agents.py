"""The cluster fingerprint with real agent processes: a node restarted with a drifted `slots_per_rank` (it passes
`--check`: its config alone is valid) refuses to vote and to propose, says so in `emoe status` naming the
field, and the others name it too; the cluster commits without it, and once its config agrees again (restarted
with the right one) it serves and votes again. An engine rank whose boot placement is not the agents' genesis
(the plugin's GENESIS_MISMATCH) is named by its agent's `emoe status` too."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest

from chaos.localcluster import LocalCluster, stable_ports
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import GenesisMismatch, PluginCore
from elasticmoe.v1 import consensus_pb2 as cpb
from elasticmoe.v1 import consensus_pb2_grpc
from tests.adminclient import emoe, status
from tests.conftest import until

pytestmark = pytest.mark.slow

SHAPE = {"nodes": 3, "ranks_per_node": 2, "slots_per_rank": 4, "layers": 2, "experts": 8, "top_k": 2}


def _health(c: LocalCluster, k: int) -> str:
    """Agent k's health, "" while it does not answer yet (it starts: not SERVING, so nobody waited for it)."""
    try:
        return status(c.addresses[k]).health
    except grpc.RpcError:
        return ""


def _as_node1(c: LocalCluster, k: int, method: str, req: object) -> object:
    """A consensus call to agent k as node1 would make it (plaintext agents take the caller's word)."""
    with grpc.insecure_channel(c.addresses[k]) as ch:
        stub = consensus_pb2_grpc.ConsensusStub(ch)  # type: ignore[no-untyped-call]
        return getattr(stub, method)(req, timeout=5, metadata=(("x-emoe-from", "node1"),))


def test_a_node_with_a_drifted_slots_per_rank_refuses_to_vote_and_status_names_the_field(tmp_path: Path) -> None:
    c = LocalCluster(3, tmp_path, SHAPE, ports=stable_ports(3))
    good = c.configs[2].read_text()
    drifted = good.replace("slots_per_rank = 4", "slots_per_rank = 5")
    assert drifted != good
    c.configs[2].write_text(drifted)
    assert emoe("agent", "--config", str(c.configs[2]), "--check").returncode == 0  # valid on its own
    try:
        c.start()
        c.wait_healthy(timeout=60, which=[0, 1])
        until("node3 says it abstains", lambda: "slots_per_rank = 5 here, 4 on node1" in _health(c, 2), timeout=60)
        st = status(c.addresses[2])
        assert st.health.startswith("NOT_SERVING: cluster fingerprint differs") and "neither votes" in st.health
        text = emoe("status", "--agent", c.addresses[2]).stdout
        assert "slots_per_rank = 5 here, 4 on node1" in text, text
        for k in (0, 1):  # the others name it, and keep serving
            until(f"{c.ids[k]} names node3", lambda k=k: [m.node_id for m in status(c.addresses[k]).fingerprint_mismatches]
                  == ["node3"])
            (m,) = status(c.addresses[k]).fingerprint_mismatches
            assert m.fields.startswith("slots_per_rank = 4 here, 5 there; genesis = "), m.fields
            assert status(c.addresses[k]).health == "SERVING"
        doc = json.loads(emoe("status", "--json", "--agent", c.addresses[0]).stdout)
        assert doc["fingerprint_mismatches"][0]["node_id"] == "node3"

        # it refuses to vote: an accept (of a table, or of a pause record) is refused with the reason
        acc = _as_node1(c, 2, "Accept", cpb.AcceptRequest(proposal=cpb.Proposal(
            version=2, ballot=cpb.Ballot(round=0, node_id="node1")), from_node="node1"))
        assert isinstance(acc, cpb.Accepted) and not acc.ok and "slots_per_rank" in acc.reason, acc
        ack = _as_node1(c, 2, "ControlAccept", cpb.ControlAcceptRequest(
            record=cpb.ControlRecord(seq=1, node_id="node1", paused=True), from_node="node1"))
        assert isinstance(ack, cpb.ControlAck) and not ack.ok and "fingerprint" in ack.reason, ack
        # ... and to propose
        r = emoe("propose", "--force", "--agent", c.addresses[2], "replicate", "0", "0", "5")
        assert r.returncode != 0 and "NOT_SERVING" in r.stderr and "slots_per_rank" in r.stderr, r.stderr
        # the others commit without it
        r = emoe("propose", "--force", "--json", "--agent", c.addresses[0], "replicate", "0", "0", "5")
        assert r.returncode == 0 and json.loads(r.stdout)["committed"] is True, r.stderr
        assert emoe("pause", "--agent", c.addresses[1]).returncode == 0

        # an engine that booted with another placement than the agents' genesis: its plugin stops, and says why
        topo = Topology(3, 2, 4)
        boot = genesis_table("vllm", topo, 2, 8).phy2log  # the agents' genesis is "static"
        link = LinkThread(c.shim_socket(0), 1, shim_id="rank1", ranks=[1])
        try:
            with pytest.raises(GenesisMismatch):
                PluginCore(link, topo, 2, 8, 1, boot, genesis="static")  # type: ignore[arg-type]
        finally:
            link.close()
        until("node1 names rank 1's genesis mismatch", lambda: status(c.addresses[0]).ranks[1].error.startswith(
            "GENESIS_MISMATCH: the engine booted with placement"))
        assert "GENESIS_MISMATCH" in emoe("status", "--agent", c.addresses[0]).stdout

        # restarted with the cluster's config it serves and votes again
        c.signal(2, signal.SIGTERM)
        proc = c.procs[2]
        assert proc is not None
        proc.wait(timeout=30)
        c.configs[2].write_text(good)
        c.start(2)
        c.wait_healthy(timeout=60, which=[2])
        for k in (0, 1):
            until(f"{c.ids[k]} sees node3 agree", lambda k=k: not status(c.addresses[k]).fingerprint_mismatches)
        until("node3 learns the head and the pause", lambda: status(c.addresses[2]).paused and status(c.addresses[2]).committed_version
              == status(c.addresses[0]).committed_version >= 2)
    finally:
        c.stop()
