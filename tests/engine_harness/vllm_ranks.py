"""Two EP ranks of vLLM's real EPLB machinery on CPU (gloo), with the plugin loaded through vLLM's own
`load_general_plugins()`, beside real agents. Run by tests/engines/test_engine_vllm.py with the engine virtualenv:

    python tests/engine_harness/vllm_ranks.py --out DIR --sockets S0,S1 [--port P] [--hold-rank 1]
    python tests/engine_harness/vllm_ranks.py --out DIR --sockets X,Y --commits CDIR   # no agents
    python tests/engine_harness/vllm_ranks.py ... --die-rank 1 --die-at-step 20         # a rank lost
    python tests/engine_harness/vllm_ranks.py ... --mode async --layers 8 --layer-delay 0.1  # vLLM's defaults

Each rank builds vLLM's `EplbState` for a toy model with vLLM's `MixtureOfExperts` attributes (expert
weights encode `layer * 100 + expert`), then runs steps until DIR/stop exists: it writes load into
`expert_load_pass` (logical expert 0 hot), calls `EplbState.step()`, checks that every local slot's weights
are those of the expert `physical_to_logical_map` names, and writes DIR/rank{r}.json (and its pid, once, to
DIR/pid{r}). The rank named by `--hold-rank` withholds the commits its link delivers until DIR/release exists
(a version only one rank has received). `VLLM_RANKS_CAP=RANK:VERSION` in the environment makes rank RANK's link pass on no commit newer
than VERSION, ever (a rank that stopped taking tables: vLLM's MIN agreement holds every rank on VERSION, and
each rank keeps reporting the version it runs). The rank named by `--die-rank` exits abruptly; its peer's failed step writes DIR/failure{r}.json
with the unreachable ranks its plugin reported. Test-only CPU stand-ins: `torch.accelerator.current_stream`,
`torch.accelerator.set_stream` and `torch.Event`.

`--mode async` runs vLLM's EPLB defaults (use_async, window_size 1000, step_interval 3000; the gloo
communicator, as on CPU) with vLLM's own async worker loop (`async_worker.transfer_run_periodically`) in a
thread of each rank, as `start_async_worker` runs it on a GPU (a stand-in stream, since the CPU has none);
`--layer-delay S` makes that worker take S seconds more per layer (a longer window in which a move is in
flight). `--rocm` makes vLLM's `current_platform.is_rocm()` true (its sync-mode 5% gain rule applies).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

L, E, R, H = 2, 8, 2, 16
WS = 2
P = E + R
NL = P // WS
INTERVAL = 8
HOT = 50


def cpu_stand_ins() -> None:
    torch.accelerator.current_stream = lambda *a, **k: types.SimpleNamespace(synchronize=lambda: None)
    torch.accelerator.set_stream = lambda *a, **k: None

    class Event:  # torch.Event(...).record() raises on the CPU backend
        def __init__(self, *a: Any, **k: Any) -> None:
            self.t = 0.0

        def record(self, *a: Any, **k: Any) -> None:
            self.t = time.perf_counter()

        def synchronize(self) -> None:
            pass

        def wait(self, *a: Any, **k: Any) -> None:
            pass

        def elapsed_time(self, other: Event) -> float:
            return (other.t - self.t) * 1000.0

    torch.Event = Event


class HeldLink:
    """Wraps the plugin's link: commits stay back until `release` exists."""

    def __init__(self, inner: Any, release: Path) -> None:
        self.inner, self.release = inner, release
        self.held: list[Any] = []

    @property
    def dropped(self) -> int:
        return int(self.inner.dropped)

    @property
    def next_step(self) -> int:
        return int(self.inner.next_step)

    def drain(self) -> list[Any]:
        self.held += self.inner.drain()
        if not self.release.exists():
            return []
        out, self.held = self.held, []
        return out

    def offer(self, report: Any) -> None:
        self.inner.offer(report)

    def go_on_from(self, step: int) -> None:
        self.inner.go_on_from(step)

    def report(self, report: Any, timeout: float) -> Any:
        return self.inner.report(report, timeout)

    def close(self) -> None:
        self.inner.close()


class CapLink:
    """Wraps the plugin's link: commits newer than `cap` are kept back for good (`VLLM_RANKS_CAP`)."""

    def __init__(self, inner: Any, cap: int) -> None:
        self.inner, self.cap = inner, cap
        self.kept: list[Any] = []

    @property
    def dropped(self) -> int:
        return int(self.inner.dropped)

    @property
    def next_step(self) -> int:
        return int(self.inner.next_step)

    def drain(self) -> list[Any]:
        got = self.inner.drain()
        self.kept += [c for c in got if c.table.version > self.cap]
        return [c for c in got if c.table.version <= self.cap]

    def offer(self, report: Any) -> None:
        self.inner.offer(report)

    def go_on_from(self, step: int) -> None:
        self.inner.go_on_from(step)

    def report(self, report: Any, timeout: float) -> Any:
        return self.inner.report(report, timeout)

    def close(self) -> None:
        self.inner.close()


def innermost(link: Any) -> Any:
    while hasattr(link, "inner"):
        link = link.inner
    return link


class DirLink:
    """A link without an agent: certified commits are files DIR/v{version}.commit (serialized `Commit`s)
    that the test writes; offered load reports are kept, the last one shown in the status file."""

    def __init__(self, d: Path) -> None:
        self.dir, self.seen, self.dropped, self.sent, self.next_step = d, 0, 0, 0, 0
        self.last: Any = None
        self.offered: list[Any] = []  # every report offered, in order

    def drain(self) -> list[Any]:
        from elasticmoe.v1 import consensus_pb2 as cpb

        out = []
        for f in sorted(self.dir.glob("v*.commit"), key=lambda f: int(f.stem[1:])):
            if int(f.stem[1:]) > self.seen:
                out.append(cpb.Commit.FromString(f.read_bytes()))
                self.seen = int(f.stem[1:])
        return out

    def offer(self, report: Any) -> None:
        self.last, self.sent = report, self.sent + 1
        self.offered.append(report)

    def go_on_from(self, step: int) -> None:
        pass

    def report(self, report: Any, timeout: float) -> None:
        self.offer(report)

    def close(self) -> None:
        pass


class Toy:
    """vLLM's MixtureOfExperts surface, no layers: EplbState reads these and moves `expert_weights`."""

    num_expert_groups = 1
    num_logical_experts = E
    num_routed_experts = E
    num_redundant_experts = R
    num_physical_experts = P
    num_local_physical_experts = NL
    num_shared_experts = 0
    moe_layers: list[Any] = []

    def __init__(self, rank: int, p2l: list[int]) -> None:
        self.num_moe_layers = L
        w = torch.tensor([[float(layer * 100 + p2l[rank * NL + i]) for i in range(NL)] for layer in range(L)])
        self.expert_weights = [[w[layer][:, None].repeat(1, H).contiguous(),
                                (2 * w[layer])[:, None].repeat(1, 2 * H).contiguous()] for layer in range(L)]

    def set_eplb_state(self, expert_load_view: Any, logical_to_physical_map: Any, logical_replica_count: Any) -> None:
        self.load_view, self.l2p, self.rc = expert_load_view, logical_to_physical_map, logical_replica_count

    def update_physical_experts_metadata(self, *a: Any) -> None:
        pass


def weights_match(model: Toy, p2l: torch.Tensor, rank: int) -> bool:
    """Every filled local slot holds the weights of the expert the map names (empty slots: anything)."""
    for layer in range(L):
        want = p2l[layer, rank * NL : (rank + 1) * NL]
        filled = want >= 0
        got0, got1 = model.expert_weights[layer][0][:, 0], model.expert_weights[layer][1][:, 0]
        exp = (layer * 100 + want).float()
        if not (torch.equal(got0[filled], exp[filled]) and torch.equal(got1[filled], 2 * exp[filled])):
            return False
    return True


def _stop_agreed(plugin: Any, mine: bool) -> bool:
    """Whether any rank wants to stop, agreed by both (one MAX all-reduce): a rank that left the step loop
    alone would wait in the bench's barrier while its peer waits in a step's collective, forever."""
    flag = torch.tensor([int(mine)], dtype=torch.int64)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=plugin.group)
    return bool(flag.item())


def bench(st: Any, plugin: Any, ms: Any, n: int, rounds: int, every: tuple[int, int]) -> dict[str, Any]:
    """The plugin's own work per step inside `EplbState.step()` (all of its wrapper but vLLM's step), both
    ranks stepping back to back: `rounds` rounds alternating between agreement and report every step (1, 1)
    and every `every` = (K, R) steps, `n` steps each, so both are measured side by side on the same noisy
    machine. A barrier (untimed) before each step stands in for the forward pass's collectives, which keep
    the ranks in step in an engine: without it the agreement would time the peers' skew. Per round: the mean (amortised) and p99 per step, of the whole and of its agreement part;
    the medians over rounds are returned. Both ranks switch settings at the same step (the schedule must be
    the same on every rank)."""
    import numpy as np

    out: dict[str, Any] = {"n": n, "rounds": rounds}
    per: dict[str, dict[str, list[float]]] = {}
    forward = torch.distributed.new_group(backend="gloo")  # the forward's collectives: not the plugin's group
    for _ in range(rounds):
        for k, r in ((1, 1), every):
            plugin.inst.agree_every, plugin.core.report_every = k, r
            plugin.inst.step = 0  # the same on both ranks: agreement at step 0, k, 2k ...
            torch.distributed.barrier(group=plugin.group)
            plugin.timings.plugin_us.clear()
            plugin.timings.agree_us.clear()
            plugin.timings.load_us.clear()
            for _ in range(n):
                ms.expert_load_pass.fill_(1)
                torch.distributed.barrier(group=forward)  # the forward pass's all-to-all keeps ranks in step
                st.step()
            tot, agr = np.array(plugin.timings.plugin_us), np.array(plugin.timings.agree_us)
            load = np.array(plugin.timings.load_us)
            d = per.setdefault(f"k{k}_r{r}", {"mean_us": [], "p99_us": [], "agree_mean_us": [], "agree_p99_us": [],
                                              "load_mean_us": []})
            d["mean_us"].append(float(tot.mean()))
            d["p99_us"].append(float(np.percentile(tot, 99)))
            d["agree_mean_us"].append(float(agr.mean()))
            d["agree_p99_us"].append(float(np.percentile(agr, 99)))
            d["load_mean_us"].append(float(load.mean()))
    for key, d in per.items():
        out[key] = {m: float(np.median(v)) for m, v in d.items()}
    return out


def _counts(report: Any) -> list[list[int]] | None:
    import numpy as np

    if report is None:
        return None
    return np.frombuffer(report.counts, "<u4").reshape(report.layers, report.experts).tolist()


def _last_sample(link: Any) -> dict[str, Any] | None:
    """The newest sampled step among the offered reports: its step and counts, with the report's rate."""
    import numpy as np

    from elasticmoe.loadcodec import sample_steps

    for r in reversed(getattr(link, "offered", [])):
        steps = list(sample_steps(r.first_step, r.steps, r.sample_every))
        if steps:
            rows = np.frombuffer(r.samples, "<u4").reshape(len(steps), r.layers, r.experts)
            return {"step": steps[-1], "every": r.sample_every, "rows": len(steps), "counts": rows[-1].tolist()}
    return None


def write(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def async_worker_thread(st: Any, layer_delay: float) -> None:
    """vLLM's own async EPLB loop in a daemon thread, as `start_async_worker` runs it (which would first bind
    a device; the CPU has none): a stand-in stream. `layer_delay` slows each layer's transfer."""
    from vllm.distributed.eplb import async_worker

    if layer_delay > 0:
        inner = async_worker.transfer_layer

        def slow(*a: Any, **k: Any) -> Any:
            time.sleep(layer_delay)
            return inner(*a, **k)

        async_worker.transfer_layer = slow
    stream = types.SimpleNamespace(synchronize=lambda: None)
    threading.Thread(target=async_worker.transfer_run_periodically, kwargs={"state": st, "stream": stream},
                     daemon=True).start()


def worker(rank: int, args: argparse.Namespace) -> None:
    global L
    L = args.layers
    cpu_stand_ins()
    out = Path(args.out)
    (out / f"pid{rank}").write_text(str(os.getpid()))  # whose death tests/engines/test_engine_harness.py checks
    os.environ["EMOE_SOCKET"] = args.sockets.split(",")[rank]
    os.environ.setdefault("EMOE_REPORT_EVERY", "1")
    os.environ.setdefault("EMOE_AGREE_EVERY", "4")
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.parallel import EPLBConfig
    from vllm.distributed.eplb.eplb_state import EplbState
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # our entry point: patches EplbState.add_model
    from dataplane_shim import vllm_plugin

    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=WS, enable_expert_parallel=True))
    pc = vc.parallel_config
    pc.enable_eplb = True  # refused by ParallelConfig's validation on CPU: set after construction
    if args.mode == "async":  # vLLM's defaults (use_async, window 1000, interval 3000); gloo as on CPU
        pc.eplb_config = EPLBConfig(num_redundant_experts=R, communicator="torch_gloo")
    else:
        pc.eplb_config = EPLBConfig(window_size=2, step_interval=INTERVAL, num_redundant_experts=R, use_async=False,
                                    communicator="torch_gloo")
    with set_current_vllm_config(vc):
        init_distributed_environment(WS, rank, f"tcp://127.0.0.1:{args.port}", rank, "gloo")
        initialize_model_parallel(tensor_model_parallel_size=WS)
        model = Toy(rank, list(EplbState.build_initial_global_physical_to_logical_map(E, R)))
        mc = types.SimpleNamespace(model="toy", compute_hash=lambda: "toyhash")
        st = EplbState(pc, torch.device("cpu"))
        st.add_model(model, mc)
        plugin = st.elasticmoe
        ms = st.model_states["toyhash"]
        if args.rocm:
            from vllm.platforms import current_platform

            current_platform.is_rocm = lambda: True
        if st.is_async:
            async_worker_thread(st, args.layer_delay)
        if args.commits:
            plugin.link.close()
            plugin.link = plugin.core.link = DirLink(Path(args.commits) / f"rank{rank}")
        if rank == args.hold_rank:
            plugin.link = plugin.core.link = HeldLink(plugin.link, out / "release")
        cap = os.environ.get("VLLM_RANKS_CAP", "")
        if cap and int(cap.split(":")[0]) == rank:
            plugin.link = plugin.core.link = CapLink(plugin.link, int(cap.split(":")[1]))
        step, deadline = 0, time.monotonic() + args.max_s
        ok = True
        while not args.bench_only:
            try:  # the stop flag's all-reduce stands in for the forward's collectives: it fails first, often
                if _stop_agreed(plugin, (out / "stop").exists() or time.monotonic() >= deadline):
                    break
                p2l = ms.physical_to_logical_map
                ms.expert_load_pass.copy_(torch.where(p2l == 0, HOT, 1).to(ms.expert_load_pass.dtype))
                if rank == args.die_rank and step == args.die_at_step:
                    os._exit(0)  # kill -9 of this rank, as far as its peers can tell: its sockets close
                st.step()
            except RuntimeError as e:  # a peer is gone: the plugin's failed agreement names whom (gloo's thread)
                until = time.monotonic() + 10
                while not plugin.lost_peers and time.monotonic() < until:
                    time.sleep(0.05)
                write(out / f"failure{rank}.json", {"rank": rank, "step": step, "error": str(e)[:300],
                                                    "lost": plugin.lost_peers, "reports": plugin.core.stats.reports})
                os._exit(0)
            step += 1
            ok = ok and weights_match(model, ms.physical_to_logical_map, rank)
            write(out / f"rank{rank}.json", {
                "rank": rank, "step": step, "version": plugin.core.version, "held": sorted(plugin.core.tables),
                "p2l": ms.physical_to_logical_map.tolist(), "l2p_width": int(ms.logical_to_physical_map.shape[-1]),
                "replica_count": ms.logical_replica_count.tolist(), "weights_ok": ok,
                "installs": plugin.core.stats.installs, "reports": plugin.core.stats.reports,
                "sent": int(innermost(plugin.link).sent), "dropped": int(plugin.link.dropped),
                "timings": plugin.timings.medians(), "status": vllm_plugin.status(),
                "policy": st.policy.__name__, "install": plugin.install_status(),
                "window_load": int(ms.expert_load_window.sum()), "mode": args.mode,
                "last_report": _counts(getattr(plugin.link, "last", None)),
                "last_sample": _last_sample(innermost(plugin.link)),
                "kept": sorted(c.table.version for c in getattr(plugin.link, "kept", [])),
            })
            time.sleep(args.step_s)
        if args.bench:
            k, r = (int(x) for x in args.bench_every.split(","))
            write(out / f"bench{rank}.json", bench(st, plugin, ms, args.bench, args.bench_rounds, (k, r)))
        plugin.close()
        destroy_model_parallel()
        destroy_distributed_environment()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--sockets", required=True, help="the agent socket of rank 0 and of rank 1, comma-separated")
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--hold-rank", type=int, default=-1)
    ap.add_argument("--commits", default="", help="no agents: read certified commits from DIR/rank{r}/")
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--max-s", type=float, default=240.0)
    ap.add_argument("--bench", type=int, default=0, help="after the run: time this many agreements and reports")
    ap.add_argument("--die-rank", type=int, default=-1, help="this rank exits abruptly at --die-at-step")
    ap.add_argument("--die-at-step", type=int, default=20)
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--layers", type=int, default=L)
    ap.add_argument("--layer-delay", type=float, default=0.0, help="async: seconds added to each layer's transfer")
    ap.add_argument("--rocm", action="store_true", help="vLLM's current_platform.is_rocm() returns True")
    ap.add_argument("--bench-only", action="store_true", help="skip the stepping loop: only the benchmark")
    ap.add_argument("--bench-rounds", type=int, default=5)
    ap.add_argument("--bench-every", default="16,16", help="K,R: agreement and report period compared with 1,1")
    a = ap.parse_args()
    mp.spawn(worker, args=(a,), nprocs=WS, join=True)
    print("RANKS_DONE", flush=True)
    sys.exit(0)
