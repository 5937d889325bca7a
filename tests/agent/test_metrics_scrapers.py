"""Scraping /metrics cannot make an agent look dead (issue 48, finding 4): 3 agent processes at DeepSeek-V3
shape (58 MoE layers x 256 experts) with `[metrics] per_expert = true`, fed load through their shim sockets by
one engine plugin core per EP rank, so that every scrape holds the 14,848 per-expert series. 8 concurrent
scrapers against one agent for 30 s: meanwhile no member's incarnation changes and no agent ever holds a member
suspect (Admin/Status of every agent, polled), `emoe status` of the scraped agent keeps its p95 within 1.5x the p95
this same test measured before the scrapers started, and the scrapers share pages (at most one new a second)."""

from __future__ import annotations

import gzip
import hashlib
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from chaos.localcluster import LocalCluster, free_ports
from controlplane.topology import Topology
from dataplane_shim.genesis import genesis_table
from dataplane_shim.link import LinkThread
from dataplane_shim.plugin import PluginCore
from elasticmoe.v1 import gossip_pb2 as gpb
from tests.adminclient import emoe, status
from tests.conftest import until

pytestmark = pytest.mark.slow

L, E, TOP_K = 58, 256, 8  # DeepSeek-V3
NODES, RPN, S = 3, 2, 48
SHAPE = {"nodes": NODES, "ranks_per_node": RPN, "slots_per_rank": S, "layers": L, "experts": E, "top_k": TOP_K}
# a window every ~1 s of feeding; no plan ever (theta out of reach, no cost-benefit): the agents' CPU goes to
# gossip, windows and /metrics only, so that what the scrapers cost is what the test sees
DECISION = {"window": 20, "sample_every": 0, "theta": 1e6, "load_ms": 0.0}
STEPS = 10  # steps of load per report (one feeding round)
SCRAPERS, BASELINE_S, SCRAPE_S = 8, 20.0, 30.0
SCRAPE_PAUSE_S = 0.1  # each scraper's pause after an answer (Prometheus: 15-60 s): up to 80 scrapes a second


def _timed_status(address: str) -> float:
    t0 = time.monotonic()
    r = emoe("status", "--agent", address, timeout=30)
    assert r.returncode == 0, r.stderr
    return time.monotonic() - t0


def _p95(samples: list[float]) -> float:
    return float(np.percentile(samples, 95))


def test_concurrent_scrapers_of_per_expert_series_never_make_an_agent_look_dead(tmp_path: Path) -> None:
    ports = free_ports(NODES)
    c = LocalCluster(NODES, tmp_path, SHAPE, profile="test", sections={"decision": DECISION})
    for cfg, port in zip(c.configs, ports, strict=True):
        cfg.write_text(cfg.read_text() + f'\n[metrics]\nlisten = "127.0.0.1:{port}"\nper_expert = true\n')
    # as Prometheus asks (a server may answer plain text)
    request = urllib.request.Request(f"http://127.0.0.1:{ports[0]}/metrics", headers={"Accept-Encoding": "gzip"})
    topo = Topology(NODES, RPN, S)
    boot = genesis_table("static", topo, L, E).phy2log
    stop, errors = threading.Event(), []

    def engines(cores: list[PluginCore]) -> None:
        load = np.full((L, E), 2 * STEPS, np.int64)  # 2 tokens per expert per step: 64 tokens x top-8 a step
        try:
            while not stop.is_set():
                for core in cores:
                    core.add_load(load, STEPS)
                    core.maybe_report()
                red = np.min([core.agreement_vector() for core in cores], axis=0)
                for core in cores:
                    if (t := core.decide(red)) is not None:
                        core.installed(t.version)
                stop.wait(0.5)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            errors.append(e)

    # each non-alive state or incarnation other than the phase's first an agent held: while scraped (judged), and
    # before (shown only: on a loaded box the machine itself may stall an agent, scrapers or not)
    seen: dict[str, None] = {}
    before: dict[str, None] = {}
    phases: list[tuple[dict[str, None], dict[str, int]]] = []  # the watcher's: the current phase's, and its first

    def incarnations() -> dict[str, int]:
        return {m.node_id: m.incarnation for m in status(c.addresses[0]).members}

    def watch(until_: threading.Event) -> None:
        while not until_.is_set():
            into, first = phases[-1]
            for k in range(NODES):
                try:
                    members = status(c.addresses[k], timeout=10).members
                except Exception as e:  # noqa: BLE001 - a Status call that fails (times out) is shown with the rest
                    into[f"{c.ids[k]}: Status failed: {e!r}"[:200]] = None
                    continue
                for m in members:
                    if m.status != gpb.ALIVE or m.incarnation != first.get(m.node_id):
                        into[f"{c.ids[k]} holds {m.node_id} {gpb.MemberStatus.Name(m.status)} "
                             f"at incarnation {m.incarnation} (was {first.get(m.node_id)})"] = None
            until_.wait(0.5)

    scrapes: list[bytes] = []
    pages: set[bytes] = set()  # the digests of the pages served: how many renders the scrapes cost
    scrape_errors: list[str] = []

    def scraper(until_: threading.Event) -> None:
        while not until_.is_set():
            try:
                body = urllib.request.urlopen(request, timeout=30).read()
                scrapes.append(body if len(scrapes) < 1 else b"")  # keep one body to parse, count the rest
                pages.add(hashlib.blake2b(body, digest_size=16).digest())
            except Exception as e:  # noqa: BLE001 - counted and shown
                scrape_errors.append(repr(e)[:200])
            until_.wait(SCRAPE_PAUSE_S)

    with c.running(timeout=60):
        links = [LinkThread(c.shim_socket(g // RPN), 1, shim_id=f"rank{g}", ranks=[g]) for g in range(topo.ranks)]
        cores = [PluginCore(link, topo, L, E, g, boot, genesis="static", report_every=STEPS)
                 for g, link in enumerate(links)]
        feed = threading.Thread(target=engines, args=(cores,), daemon=True)
        feed.start()
        watched, scraping = threading.Event(), threading.Event()
        threads: list[threading.Thread] = []
        try:
            until("every agent closed windows of its engines' load",
                  lambda: all(status(a).window_seq >= 2 for a in c.addresses), timeout=60.0)
            first_view = status(c.addresses[0]).members
            assert sorted(m.node_id for m in first_view) == c.ids and all(m.status == gpb.ALIVE for m in first_view)
            phases.append((before, incarnations()))
            threads.append(threading.Thread(target=watch, args=(watched,), daemon=True))
            threads[-1].start()

            t_end = time.monotonic() + BASELINE_S
            alone: list[float] = []
            while time.monotonic() < t_end:
                alone.append(_timed_status(c.addresses[0]))
            first = incarnations()
            phases.append((seen, first))
            for _ in range(SCRAPERS):
                threads.append(threading.Thread(target=scraper, args=(scraping,), daemon=True))
                threads[-1].start()
            t_start = time.monotonic()
            t_end = t_start + SCRAPE_S
            scraped: list[float] = []
            while time.monotonic() < t_end:
                scraped.append(_timed_status(c.addresses[0]))
            scraping.set()
            time.sleep(1.0)  # what the last scrapes caused, the watcher still sees
            watched.set()
            for th in threads:
                th.join(40)
            scraped_s = time.monotonic() - t_start
            assert not errors, errors
            last = [status(a).members for a in c.addresses]
            p95_alone, p95_scraped = _p95(alone), _p95(scraped)
            report = (f"emoe status p95 {p95_alone:.2f} s alone ({len(alone)} runs), {p95_scraped:.2f} s under "
                      f"{SCRAPERS} scrapers ({len(scraped)} runs); {len(scrapes)} scrapes of {len(pages)} pages "
                      f"in {scraped_s:.0f} s, "
                      f"{len(scrape_errors)} failed {scrape_errors[:2]}; alone {sorted(round(x, 2) for x in alone)}, "
                      f"scraped {sorted(round(x, 2) for x in scraped)}; without scrapers {list(before)[:4]}")
            print(report)
            assert not seen, f"{len(seen)} suspicions, refutations or failed Status calls: {list(seen)[:6]}; {report}"
            assert all(m.incarnation == first[m.node_id] and m.status == gpb.ALIVE for ms in last for m in ms), last
            assert p95_scraped <= 1.5 * p95_alone, report
            # concurrent scrapers share one render: a page at most once a second (deploy/OPERATIONS.md), not one a
            # scrape (each render's emoe_seconds_since_commit differs: a page rendered anew is new bytes)
            assert len(pages) <= scraped_s + 2, report
            # the scrapes were real: every scraper got answers, in valid Prometheus text, per-expert series and all
            from prometheus_client.parser import text_string_to_metric_families

            assert len(scrapes) >= SCRAPERS and not scrape_errors, report
            body = scrapes[0]
            fams = {f.name: f for f in text_string_to_metric_families(
                (gzip.decompress(body) if body[:2] == b"\x1f\x8b" else body).decode())}
            assert len(fams["emoe_expert_tokens"].samples) == L * E
            assert sum(s.value for s in fams["emoe_expert_tokens"].samples) > 0
        finally:
            stop.set()
            scraping.set()
            watched.set()
            feed.join(5)
            for link in links:
                link.close()
