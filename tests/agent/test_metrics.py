"""Prometheus metrics (`[metrics] listen`, agent/admin/metrics.py): 3 agent processes, one engine plugin core per EP
rank reporting skewed load and installing what the agents commit; each agent's /metrics, parsed with
prometheus-client's own parser, agrees with its `emoe status --json` taken at the same moment."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chaos.localcluster import ROOT, LocalCluster, free_ports
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import PluginCore
from tests.conftest import until as _until

pytestmark = pytest.mark.slow

L, E, NODES, RPN, S = 2, 8, 3, 2, 4
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": 2}


def _status(c: LocalCluster, k: int) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "agent.cli", "status", "--json", "--agent", c.addresses[k]], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    for key in ("committed_version", "window_seq"):  # (uint64 fields: strings in protobuf's JSON)
        doc[key] = int(doc.get(key, 0))
    return doc


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out



def test_three_agents_metrics_agree_with_their_status(tmp_path: Path) -> None:
    ports = free_ports(NODES)
    c = LocalCluster(NODES, tmp_path, SHAPE, profile="test", sections={"decision": {"window": 10, "sample_every": 5}})
    for cfg, port in zip(c.configs, ports, strict=True):
        cfg.write_text(cfg.read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\n')
    topo = Topology(NODES, RPN, S)
    boot = genesis_table("static", topo, L, E).phy2log
    stop, idle, errors = threading.Event(), threading.Event(), []

    def engines(cores: list[PluginCore]) -> None:
        try:
            load = np.ones((L, E), np.int64)
            load[:, 0] = 60  # expert 0 hot in every layer: its rank is the busiest until replicas spread it
            while not stop.is_set():
                for core in cores:
                    if idle.is_set():  # attached, agreeing and installing, but serving no tokens
                        continue
                    offs = core.sampled(1)
                    core.add_load(load, 1, load[None] if offs else None)
                    core.maybe_report()
                red = np.min([core.agreement_vector() for core in cores], axis=0)
                for core in cores:
                    if (t := core.decide(red)) is not None:
                        core.installed(t.version)
                time.sleep(0.02)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    with c.running(timeout=60):
        links = [LinkThread(c.shim_socket(g // RPN), 1, shim_id=f"rank{g}", ranks=[g]) for g in range(topo.ranks)]
        cores = [PluginCore(link, topo, L, E, g, boot, genesis="static", report_every=5, sample_every=5)  # type: ignore[arg-type]
                 for g, link in enumerate(links)]
        th = threading.Thread(target=engines, args=(cores,), daemon=True)
        th.start()
        try:
            _until("a rebalance committed and installed on every rank", lambda: all(
                (s := _status(c, k))["committed_version"] >= 2 and s["window_seq"] >= 3
                and all(int(r["installed_version"]) == int(s["committed_version"]) for r in s["ranks"])
                for k in range(NODES)), timeout=40.0)
            idle.set()  # the engines stay attached and install but serve nothing: no window closes from here
            time.sleep(1.0)

            def settled() -> bool:  # (a decision on the last windows may still commit: wait for its install)
                before = [_status(c, k) for k in range(NODES)]
                time.sleep(0.5)
                after = [_status(c, k) for k in range(NODES)]
                return all(a["committed_version"] == b["committed_version"] and all(
                    int(r["installed_version"]) == a["committed_version"] for r in a["ranks"])
                    for a, b in zip(after, before, strict=True))

            _until("the last commit installed everywhere", settled, timeout=40.0)
            assert not errors, errors
            proposed = planned = 0.0
            for k in range(NODES):
                m, st = _scrape(ports[k]), _status(c, k)
                one = {name: next(iter(v.values())) for name, v in m.items() if len(v) == 1 and () in v}
                assert one["emoe_committed_version"] == st["committed_version"]
                assert one["emoe_window_seq"] == st["window_seq"] and one["emoe_serving"] == 1.0
                assert one["emoe_step_imbalance"] == pytest.approx(st["step_imbalance"])
                assert one["emoe_rebalancing_paused"] == 0.0 and 0.0 < one["emoe_seconds_since_commit"] < 60.0
                assert m["emoe_members"][(("status", "alive"),)] == NODES
                peers = {dict(lab)["member"]: int(v) for lab, v in m["emoe_member_committed_version"].items()}
                later = {n: int(v) for n, v in st.get("peer_versions", {}).items()}  # (taken just after the
                assert set(peers) == set(later) and all(1 <= peers[n] <= later[n] for n in peers)  # scrape)
                mine = {int(r["rank"]): int(r["installed_version"]) for r in st["ranks"]}
                assert sorted(mine) == [RPN * k, RPN * k + 1]
                got = {int(dict(lab)["rank"]): v for lab, v in m["emoe_rank_installed_version"].items()}
                assert got == mine and set(got.values()) == {st["committed_version"]}  # installed == the head
                ages = {int(dict(lab)["rank"]): v for lab, v in m["emoe_rank_installed_age_seconds"].items()}
                assert sorted(ages) == sorted(mine) and all(v >= 0 for v in ages.values())
                layers = sum(m["emoe_layer_tokens"].values())
                assert layers > 0 and sum(m["emoe_rank_tokens"].values()) == layers
                assert len(m["emoe_layer_tokens"]) == L and len(m["emoe_rank_tokens"]) == topo.ranks
                assert "emoe_expert_tokens" not in m  # per_expert is off by default
                assert one["emoe_moved_bytes_total"] > 0  # every agent learned the rebalance and what it copies
                assert one["emoe_reports_dropped_total"] == 0 and one["emoe_reports_unsampled_total"] == 0
                assert one["emoe_partial_windows_total"] >= 0
                outcomes = {dict(lab)["outcome"]: v for lab, v in m["emoe_decisions_total"].items()}
                assert sum(outcomes.values()) >= st["window_seq"], outcomes  # a decision (or none) a window
                proposed += outcomes.get("PROPOSED", 0)
                planned += one["emoe_plans_total"]
                if one["emoe_plans_total"]:  # a plan takes time, on the planner's worker thread
                    assert one["emoe_plan_seconds_total"] >= one["emoe_plan_last_seconds"] > 0
                else:
                    assert one["emoe_plan_seconds_total"] == 0 and "emoe_plan_last_seconds" not in m
            assert proposed >= 1  # the rebalance was some agent's proposal
            assert planned >= 1  # ... which it planned first
        finally:
            stop.set()
            th.join(5)
            for link in links:
                link.close()
