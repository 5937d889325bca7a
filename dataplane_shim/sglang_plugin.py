"""The SGLang plugin (written against SGLang 0.5.23's `sglang.srt.eplb`): each EP rank's load goes to the
local agent, agreed certified tables come back in through SGLang's own EPLB path
(`ExpertLocationMetadata.init_by_mapping` over `num_hidden_layers`, then its expert-location updater on every
rank in the same forward pass). `register()` refuses another SGLang than the release pyproject.toml's `sglang`
extra pins, unless EMOE_ALLOW_UNTESTED_ENGINE=1 (`dataplane_shim.engine_version`).

Run on CPU by tests/engines/test_engine_sglang.py: `ElasticMoeEplbManager` in two gloo ranks on SGLang's real
ServerArgs, process groups, plugin loader, boot placement, stat recorder and `ExpertLocationUpdater` (its P2P
ops move the expert weights of a certified table), with torchvision stubbed and a stand-in model that holds
`routed_experts_weights_of_layer`. NOT run: inside SGLang's scheduler and `ModelRunner` (they need a GPU), and
the lost-rank path (`peer_unreachable` on a failed agreement).

Enabled by the `sglang.srt.plugins` entry point `elasticmoe` (pyproject.toml), which SGLang's
`load_plugins()` runs in every scheduler process; `register()` does nothing unless `EMOE_SOCKET` is set.
Then it replaces the `EPLBManager` that `ModelRunner` builds under `--enable-eplb` with
`ElasticMoeEplbManager`, which keeps SGLang's `rebalance()` (recorder dump, layer chunks, weight moves
with recovery) and changes three things:
- when: instead of every `eplb_rebalance_num_iterations` passes, when the EP ranks agree on a newer
  certified version (one all-reduce MIN of an int64 [6], `dataplane_shim.agreement.Agreement`, over the MoE
  EP CPU group every EMOE_AGREE_EVERY forward passes of the shared pass count, default 32, checked equal on
  every rank at setup; it also proves the ranks are at the same pass; synchronous, taken in the pass it is
  started; `dataplane_shim/install.py`'s `Installer` (`begin_step`, `after_step`):
  the version counts as installed only once rebalance() returned on its map, one that raised or returned on
  another map is counted in `install_failures`, the latter re-armed with backoff);
- what: `_compute_expert_location_metadata` returns that version's placement (its MoE rows at the MoE
  layer ids, SGLang's current rows for the dense layers) instead of running DeepSeek EPLB;
- load out: every EMOE_REPORT_EVERY passes SGLang's expert-distribution recorder is dumped (an all-reduce
  SUM over ranks, so only EP rank 0 reports the global count to its agent). Run with
  `--expert-distribution-recorder-mode stat --expert-distribution-recorder-buffer-size K` and
  EMOE_REPORT_EVERY=K so that one dump covers exactly the passes since the last. SGLang's `rebalance()`
  empties the recorder, so right before an install (agreed by every rank at the same pass) the manager
  dumps it too and reports those passes at once, under the version they ran on: every pass is reported
  once. (A chunked rebalance, `--eplb-rebalance-layers-per-chunk`, spends a pass per chunk; those passes
  are counted and reported with the next dump; the recorder's circular buffer keeps only the last K, so a
  rebalance whose chunk passes cross a multiple of K loses the oldest of them.)
Closing: `close()` stops the agent link's and the peer watch's threads. SGLang 0.5.23 has no teardown hook
for its EPLB manager (a scheduler process ends by exit or signal), so in SGLang both end with the process:
they are daemon threads, and the agent learns of the exit from the link's closed socket.
The agents' genesis must be SGLang's boot placement (`genesis = "sglang"`, or the `--init-expert-location`
file as a placement file); the plugin refuses to run otherwise.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim import engine_version
from dataplane_shim.agreement import check_agree_every
from dataplane_shim.install import Installer
from dataplane_shim.peers import PeerWatch, default_store
from dataplane_shim.plugin import PluginCore, Settings

if TYPE_CHECKING:
    from dataplane_shim.link import LinkThread

log = logging.getLogger(__name__)


def manager_class() -> type:
    """ElasticMoeEplbManager, a subclass of SGLang's EPLBManager (imported here: SGLang is optional)."""
    import torch
    from sglang.srt.distributed.parallel_state import get_moe_ep_group
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, get_global_expert_location_metadata

    settings = Settings.from_env()

    class ElasticMoeEplbManager(EPLBManager):  # type: ignore[misc]
        def __init__(self, **kw: Any) -> None:
            super().__init__(**kw)
            self._core: PluginCore | None = None
            self._link: LinkThread | None = None
            self._target: RoutingTable | None = None
            self._passes = 0   # forward passes seen: the same count on every EP rank
            self._dumped = 0   # passes already taken out of SGLang's recorder
            self._ended: float | None = None  # when the last pass ended (a pass's wall time: the time between two)
            self._watch: PeerWatch | None = None

        def _setup(self) -> PluginCore:
            from dataplane_shim.link import LinkThread

            if settings is None:
                raise RuntimeError("EMOE_SOCKET is not set in this scheduler process")
            meta = get_global_expert_location_metadata()
            ep = get_moe_ep_group()
            self._group, self._rank, G = ep.cpu_group, ep.rank_in_group, ep.world_size
            store = default_store() if G > 1 else None
            self._watch = (PeerWatch(store, self._rank, G, prefix=f"elasticmoe/{getattr(ep, 'unique_name', 'ep')}")
                           if store is not None else None)
            self._moe_ids = sorted(self._get_model().routed_experts_weights_of_layer.keys())
            phy = meta.physical_to_logical_map_cpu.numpy().astype(np.int64)
            E, P = int(meta.num_logical_experts), int(phy.shape[1])
            self._link = LinkThread(settings.socket.replace("{rank}", str(self._rank)), 1,
                                    shim_id=f"sglang-ep{self._rank}", ranks=[self._rank])
            core = PluginCore(self._link, Topology(1, G, P // G), len(self._moe_ids), E, self._rank,
                              phy[self._moe_ids], genesis=settings.genesis, report_every=settings.report_every,
                              shim_id=f"sglang-ep{self._rank}", sample_every=settings.sample_every)
            # agreement every EMOE_AGREE_EVERY passes of the shared pass count (SGLang's rebalance() runs within
            # the pass it is armed at, or its chunks)
            if G > 1:
                check_agree_every(settings.agree_every, self._reduce_min, self._rank)
            self._inst = Installer(core, agree_every=settings.agree_every,
                                   stall_steps=settings.stall_steps or max(256, 8 * len(self._moe_ids)), rank=self._rank)
            return core

        def _reduce_min(self, vec: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.int64))
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self._group)
            return t.numpy()

        # ---- the agreement's collective (dataplane_shim.agreement.Collective): synchronous, taken at once
        def start_agreement(self, vector: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
            try:
                return np.asarray(self._reduce_min(vector), dtype=np.int64)
            except RuntimeError:  # a peer is gone: name it to the agent, then let SGLang fail as it does
                core = self._core
                if core is not None:
                    for r in self._watch.unreachable() if self._watch is not None else []:
                        core.peer_unreachable(r)
                    core.report_evidence()
                raise

        def take_agreement(self) -> npt.NDArray[np.int64] | None:
            return None  # nothing in flight: start_agreement returns the reduced vector

        def close(self) -> None:
            """Stop the agent link's and the peer watch's threads; idempotent. SGLang 0.5.23 has no teardown
            hook for its EPLB manager (a scheduler process ends by exit or signal): both are daemon threads,
            and the agent learns of the exit from the link's closed socket."""
            watch, link, self._watch, self._link = self._watch, self._link, None, None
            if watch is not None:
                watch.close()
            if link is not None:
                link.close()

        def _take_load(self, core: PluginCore) -> None:
            """Dump SGLang's recorder and add the passes since the last dump to the core. The dump is a
            collective (an all-reduce SUM over ranks), so every rank calls this at the same pass, on a schedule
            of the shared pass count and the agreed version; only EP rank 0 keeps the summed counts."""
            steps, self._dumped = self._passes - self._dumped, self._passes
            if steps == 0:
                return
            counts = get_global_expert_distribution_recorder().dump_record(output_mode="object")
            if self._rank == 0:
                c = counts["logical_count"].cpu().numpy().reshape(-1, *counts["logical_count"].shape[-2:])
                # one row a forward pass (the recorder's per-pass mode): the sampled passes' rows go too
                rows = c[core.sampled(steps)][:, self._moe_ids] if c.shape[0] == steps else None
                core.add_load(c.sum(axis=0)[self._moe_ids], steps, rows)

        def _entrypoint(self) -> Iterator[None]:
            while True:
                core = self._core = self._core or self._setup()
                inst = self._inst
                self._passes += 1
                now = time.perf_counter()
                if self._rank == 0 and self._ended is not None:  # the pass that just ended
                    core.step_took(self._passes - self._dumped - 1, (now - self._ended) * 1e6)
                self._ended = now
                if self._passes % core.report_every == 0:  # the recorder holds at most K passes of them
                    self._take_load(core)
                    core.flush()
                table = inst.begin_step(self)  # the agreement when due (this manager is the Collective), to_arm
                if table is None:
                    inst.after_step(moving=False, matched=False)
                else:
                    yield from self._install(core, inst, table)
                yield

        def _install(self, core: PluginCore, inst: Installer, table: RoutingTable) -> Iterator[None]:
            """Install `table` through SGLang's rebalance() at this pass (every rank armed it at the same one):
            installed once rebalance() returned with SGLang's map equal to the table; one that returned on
            another map (rebalance disabled, say) or raised is an install failure (`install_failures`; the
            former is re-armed with backoff, the latter propagates: SGLang fails as it does)."""
            # SGLang's rebalance() empties the recorder: report what it holds first, under the version those
            # passes ran on
            self._take_load(core)
            core.flush()
            self._target, ended, self._ended = table, False, None
            try:
                for _ in self.rebalance():  # a yield per layer chunk: each is a forward pass
                    self._passes += 1
                    inst.after_step(moving=True, matched=False)
                    yield
                ended = True
            finally:  # also when it raised, or when SGLang's reset_generator() dropped it mid-move
                self._target = None
                now = get_global_expert_location_metadata().physical_to_logical_map_cpu.numpy()
                inst.after_step(moving=False, matched=ended and np.array_equal(now[self._moe_ids], table.phy2log))

        def _check_rebalance_needed(self, average_utilization_rate_over_window: Any) -> bool:
            return True

        def _compute_expert_location_metadata(self, logical_count: Any, *, broadcast_over_world: bool) -> Any:
            if self._target is None:
                raise RuntimeError("rebalance() outside an agreed version")
            meta = get_global_expert_location_metadata()
            full = meta.physical_to_logical_map_cpu.clone()
            full[self._moe_ids] = torch.from_numpy(np.array(self._target.phy2log)).to(full.dtype)
            return ExpertLocationMetadata.init_by_mapping(self._model_config, full,
                                                          moe_ep_rank=self._elastic_global_rank())

    return ElasticMoeEplbManager


def register() -> None:
    """The `sglang.srt.plugins` entry point: with EMOE_SOCKET set, ModelRunner builds our EPLB manager.

    Another SGLang than the tested one is refused (`engine_version.check`). SGLang logs a plugin's exception
    and goes on without it, which would leave its own periodic EPLB moving experts behind the agents' back:
    so the EPLB manager ModelRunner builds under `--enable-eplb` then raises the refusal, and the scheduler
    stops."""
    if Settings.from_env() is None:
        return
    import sglang.srt.model_executor.model_runner as mr

    try:
        engine_version.check("sglang")
    except engine_version.UntestedEngine as e:
        mr.EPLBManager = _refusing(e)
        raise
    mr.EPLBManager = manager_class()
    log.info("elasticmoe: SGLang's EPLBManager replaced")


def _refusing(refusal: Exception) -> Any:
    """In EPLBManager's place: building it raises `refusal`."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise refusal

    return refuse
