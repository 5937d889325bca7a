"""The vLLM plugin: each EP rank's load goes to the local agent, agreed certified tables come back in
through vLLM's own EPLB path (its policy call, its weight mover, its map commit).

Enabled by the `vllm.general_plugins` entry point `elasticmoe` (pyproject.toml), which vLLM loads in every
process; `register()` does nothing unless `EMOE_SOCKET` is set. Then every `EplbState.add_model` (vLLM
creates one per worker when `enable_eplb` is on) attaches a `VllmPlugin` to that EplbState:

- `eplb_state.policy` becomes a subclass of vLLM's `AbstractEplbPolicy` whose `rebalance_experts`
  returns the agreed version's `phy2log` (the current map when there is none, so nothing moves);
- `eplb_state.step` is wrapped. Before vLLM's step: fold `expert_load_pass` [L, P] to logical [L, E]
  through `physical_to_logical_map` and zero it; every `EMOE_REPORT_EVERY` steps offer one LoadReport
  to the agent (never blocking; drops counted); one all-reduce MIN of an int64 pair over the EP CPU group
  (`PluginCore.decide`); if a newer version is agreed, set vLLM's step counter so that this very
  `step()` runs `rearrange()` (every rank at the same step), else keep it from reaching `step_interval`;
  after vLLM's step, a version whose map vLLM committed is marked installed.

Settings (environment, read in the worker): `EMOE_SOCKET` the agent's unix socket (`{rank}` is replaced by
the EP rank), `EMOE_GENESIS` (`vllm`, default; see `dataplane_shim.genesis`), `EMOE_REPORT_EVERY` (1).
Needs torch and vLLM (0.32); imported only inside vLLM processes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from controlplane.topology import Topology
from dataplane_shim.errors import BadInput
from dataplane_shim.peers import PeerWatch, default_store
from dataplane_shim.plugin import Link, PluginCore, Settings

log = logging.getLogger("elasticmoe.vllm")
TIMINGS_KEPT = 4096  # steps of per-step timings kept for the medians


@dataclass
class Timings:
    """Wall time of the plugin's own work per step, microseconds (the medians are what the README cites);
    the last TIMINGS_KEPT steps only, so a long-running server does not grow them without bound."""

    agree_us: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))
    load_us: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))

    def medians(self) -> dict[str, float]:
        return {k: float(np.median(v)) if v else 0.0 for k, v in (("agree_us", self.agree_us),
                                                                  ("load_us", self.load_us))}


class VllmPlugin:
    """Attached to one vLLM `EplbState` holding one model."""

    def __init__(self, eplb_state: Any, settings: Settings, *, link: Link | None = None,
                 model_key: str | None = None) -> None:
        from vllm.distributed.eplb.policy import AbstractEplbPolicy
        from vllm.distributed.parallel_state import get_ep_group

        from dataplane_shim.adapters import vllm_model_state

        self.es = eplb_state
        self.ms = vllm_model_state(eplb_state, model_key)
        model = self.ms.model
        ep = get_ep_group()
        self.group, self.rank, G = ep.cpu_group, ep.rank_in_group, ep.world_size
        self.interval = int(eplb_state.expert_rearrangement_step_interval)
        if self.interval < 2:
            raise BadInput(f"eplb_config.step_interval={self.interval}: expected >= 2 (the plugin holds vLLM's "
                           "counter one step short of it between installs)")
        L, E, S = int(model.num_moe_layers), int(model.num_logical_experts), int(model.num_local_physical_experts)
        self.topo = Topology(1, G, S)
        if link is None:
            from dataplane_shim.link import LinkThread

            link = LinkThread(settings.socket.replace("{rank}", str(self.rank)), 1, shim_id=f"vllm-ep{self.rank}",
                              ranks=[self.rank])
        self.link = link
        boot = self.ms.physical_to_logical_map.detach().cpu().numpy()
        self.core = PluginCore(link, self.topo, L, E, self.rank, boot, genesis=settings.genesis,
                               report_every=settings.report_every, shim_id=f"vllm-ep{self.rank}")
        self.E = E
        dev = self.ms.expert_load_pass.device
        self._acc = torch.zeros(L, E, dtype=torch.int64, device=dev)
        self._scratch = torch.zeros(L, E + 1, dtype=torch.int64, device=dev)
        self._acc_steps = 0
        # expert_load_pass -> logical index ([L, P], empty slots -> E): built from physical_to_logical_map on
        # first use and again after a step in which vLLM's rearrange ran (or the map tensor was replaced)
        self._idx: torch.Tensor | None = None
        self._idx_of: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.pending: int = 0
        self.failed = 0  # sync rearrangements that did not leave vLLM's map equal to the agreed table
        self.timings = Timings()
        store = default_store() if G > 1 else None
        self.watch = (PeerWatch(store, self.rank, G, prefix=f"elasticmoe/{getattr(ep, 'unique_name', 'ep')}")
                      if store is not None else None)
        self.lost_peers: list[int] = []  # named by the last failed collective
        plugin = self

        class ElasticMoePolicy(AbstractEplbPolicy):  # type: ignore[misc]
            """vLLM's policy hook: the agreed table's phy2log (the current map when none is agreed)."""

            @classmethod
            def rebalance_experts(cls, weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                                  num_ranks: int, old_global_expert_indices: torch.Tensor | None = None
                                  ) -> torch.Tensor:
                return plugin.policy_map(num_replicas, num_ranks, old_global_expert_indices)

        self.policy = ElasticMoePolicy
        eplb_state.policy = ElasticMoePolicy
        self._orig_step = eplb_state.step
        eplb_state.step = self.step
        eplb_state.elasticmoe = self
        self._hold()

    # ---- vLLM's hooks --------------------------------------------------------------------------
    def policy_map(self, num_replicas: int, num_ranks: int, old: torch.Tensor | None) -> torch.Tensor:
        if num_replicas != self.topo.slots or num_ranks != self.topo.ranks:
            raise BadInput(f"vLLM asks for {num_replicas} slots on {num_ranks} ranks: the plugin attached to "
                           f"{self.topo.slots} slots on {self.topo.ranks} ranks")
        if self.target is not None:
            return self.target.clone()
        current = self.ms.physical_to_logical_map if old is None else old
        return current.detach().cpu().clone()

    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        if is_profile:  # vLLM's memory profiling: a dummy rearrange; the policy returns the current map
            self._orig_step(is_dummy=is_dummy, is_profile=True, log_stats=log_stats)
            self._idx = None
            return
        t0 = time.perf_counter()
        if not is_dummy:
            self._fold_load()
            self._acc_steps += 1
            if self._acc_steps >= self.core.report_every:  # one device-to-host copy per report
                self.core.add_load(self._acc.cpu().numpy(), self._acc_steps)
                self.core.maybe_report()
                self._acc.zero_()
                self._acc_steps = 0
        t1 = time.perf_counter()
        target = self.core.decide(self._agree(self.core.agreement_vector()))
        t2 = time.perf_counter()
        self.timings.load_us.append((t1 - t0) * 1e6)
        self.timings.agree_us.append((t2 - t1) * 1e6)
        if target is not None and self.target is None:  # one rearrangement in flight at a time
            self.target = torch.from_numpy(np.array(target.phy2log))
            self.pending = target.version
            self.es.expert_rearrangement_step = self.interval - 1  # vLLM's step increments and rearranges
        self._orig_step(is_dummy=is_dummy, is_profile=False, log_stats=log_stats)
        if self.target is not None:
            self._idx = None  # vLLM's rearrange ran: it may have committed (part of) the new map
            if torch.equal(self.ms.physical_to_logical_map.cpu(), self.target):
                self.core.installed(self.pending)
                log.info("rank %d installed version %d through vLLM's rearrange", self.rank, self.pending)
                self.target = None
            elif not self.es.is_async:  # sync mode commits within the step: it did not; retry next step
                log.warning("rank %d: vLLM's rearrange did not install version %d; retrying", self.rank,
                            self.pending)
                self.failed += 1
                self.target = None
            # async mode: vLLM commits layer by layer over the next steps; installed once all are in
        self._hold()

    # ---- pieces ----------------------------------------------------------------------------------
    def _hold(self) -> None:
        """Keep vLLM's periodic rearrange from firing (one step short of the interval) and its layers
        recording load into expert_load_pass."""
        self.es.expert_rearrangement_step = self.interval - 2
        if getattr(self.es, "should_record_tensor", None) is not None:
            self.es.should_record_tensor.fill_(True)

    def _fold_load(self) -> None:
        """Add this step's expert_load_pass [L, P], summed per logical expert, to the device accumulator
        [L, E]; zero the pass (vLLM's own window is not used: the agents keep the history)."""
        load = self.ms.expert_load_pass
        p2l = self.ms.physical_to_logical_map
        if self._idx is None or p2l is not self._idx_of:
            self._idx, self._idx_of = p2l.masked_fill(p2l < 0, self.E).long(), p2l
        self._scratch.zero_()
        self._scratch.scatter_add_(1, self._idx, load.long())
        self._acc += self._scratch[:, : self.E]
        load.zero_()

    def _agree(self, vec: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.int64))
        if self.topo.ranks > 1:
            try:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
            except RuntimeError:
                self.peer_failure()
                raise  # the EP group is broken: vLLM's own failure handling takes it from here
        return t.numpy()

    def peer_failure(self) -> list[int]:
        """A collective of the EP group failed: name the peers that stopped beating and tell the agent at once
        (Lifeguard's local evidence: it suspects their nodes without waiting for its own probes)."""
        lost = self.watch.unreachable() if self.watch is not None else []
        self.lost_peers = lost
        for r in lost:
            self.core.peer_unreachable(r)
        if lost:
            log.warning("rank %d: EP collective failed; ranks %s stopped responding: reported to the agent",
                        self.rank, lost)
            self.core.report_evidence()
        return lost

    def close(self) -> None:
        self.es.step = self._orig_step
        if self.watch is not None:
            self.watch.close()
        close = getattr(self.link, "close", None)
        if close is not None:
            close()


# ---- entry point --------------------------------------------------------------------------------
_loaded: dict[str, Any] = {"pid": None, "patched": False, "attached": 0}


def status() -> dict[str, Any]:
    """What the entry point did in this process (for `collective_rpc` checks from a driver)."""
    return dict(_loaded, pid_now=os.getpid())


def register() -> None:
    """The `vllm.general_plugins` entry point: patch `EplbState.add_model` to attach the plugin after vLLM
    built the EPLB state, when `EMOE_SOCKET` is set."""
    _loaded["pid"] = os.getpid()
    settings = Settings.from_env()
    if settings is None or _loaded["patched"]:
        return
    from vllm.distributed.eplb.eplb_state import EplbState

    original = EplbState.add_model

    def add_model(self: Any, model: Any, model_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, model, model_config, *args, **kwargs)
        if getattr(self, "elasticmoe", None) is None:
            VllmPlugin(self, settings, model_key=model_config.compute_hash())
            _loaded["attached"] += 1

    EplbState.add_model = add_model
    _loaded["patched"] = True
    log.info("elasticmoe plugin registered in pid %d (agent socket %s)", os.getpid(), settings.socket)
