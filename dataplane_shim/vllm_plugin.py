"""The vLLM plugin: each EP rank's load goes to the local agent, agreed certified tables come back in
through vLLM's own EPLB path (its policy call, its weight mover, its map commit), in sync and async mode.

Enabled by the `vllm.general_plugins` entry point `elasticmoe` (pyproject.toml), which vLLM loads in every
process; `register()` does nothing unless `EMOE_SOCKET` is set. Then every `EplbState.add_model` (vLLM
creates one per worker when `enable_eplb` is on) attaches a `VllmPlugin` to that EplbState:

- `eplb_state.policy` becomes a subclass of vLLM's `AbstractEplbPolicy` whose `rebalance_experts`
  returns the armed version's `phy2log` (the current map when none is armed, so nothing moves). vLLM
  refuses async mode with a non-default policy because its worker thread calls the policy; this one only
  returns a tensor fixed before vLLM's `rearrange()` signals the worker and kept until vLLM reports every
  layer moved, so it reads nothing the main thread changes meanwhile: async mode is supported on purpose.
- `eplb_state.step` is wrapped. The load is vLLM's own: with its counter held short of the interval, vLLM
  records `expert_load_pass` [L, P] into its sliding window at every step (so its own window, balancedness
  logs and gain checks see the real load). Every `EMOE_REPORT_EVERY` steps, or after a step whose move may
  change the map, the plugin sums the window slots written since its last fold (no per-step work at all;
  with vLLM's window no longer than a report, it adds `expert_load_pass` to its own accumulator instead),
  folds them to logical [L, E] through the map they ran under and offers one LoadReport (never blocking;
  drops counted).
  Every `EMOE_AGREE_EVERY` steps of the plugin's own step counter (the same on every rank: every rank calls
  `step()` once per forward, dummy ones included), an all-reduce MIN over the EP CPU group agrees on the
  newest version every rank holds (`dataplane_shim.agreement`, in the step order of
  `dataplane_shim.install.Installer.begin_step`, this plugin its `Collective`). It is overlapped with the engine:
  started at one agreement step in gloo's thread, its result is taken at the next (every rank alike, so the
  schedule stays in lockstep; a failed one names the lost peers to the agent from gloo's thread at once).
  When one is agreed and vLLM is not moving weights, vLLM's step counter is set so that this very `step()`
  runs `rearrange()` on every rank.
- Done means vLLM says so: in sync mode at the end of that step; in async mode when vLLM's
  `EplbModelState.rebalanced` goes false (its `_move_to_workspace` committed the last layer, at the same
  step on every rank), never when the maps merely match mid-move. A version agreed meanwhile is queued.
- On ROCm in sync mode vLLM skips a rearrangement whose rank imbalance gain under its own load window is
  below 5%; a committed table is a decision already taken (a repair that drains a rank may raise the
  imbalance), so there the plugin calls vLLM's weight mover and map commit itself, without that rule.

Settings: `dataplane_shim.plugin.Settings` (EMOE_SOCKET, EMOE_GENESIS, EMOE_REPORT_EVERY, EMOE_AGREE_EVERY,
EMOE_STALL_STEPS). `eplb_state.elasticmoe.install_status()` is what a driver reads through `collective_rpc`.
Needs torch and vLLM (the release pyproject.toml's `vllm` extra pins; `register()` refuses any other unless
EMOE_ALLOW_UNTESTED_ENGINE=1: `dataplane_shim.engine_version`); imported only inside vLLM processes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from controlplane.table import RoutingTable
from controlplane.topology import Topology
from dataplane_shim import engine_version
from dataplane_shim.agreement import check_agree_every
from dataplane_shim.errors import BadInput
from dataplane_shim.install import Installer
from dataplane_shim.peers import PeerWatch, default_store
from dataplane_shim.plugin import Link, PluginCore, Settings

log = logging.getLogger(__name__)
TIMINGS_KEPT = 4096  # steps of per-step timings kept for the medians


@dataclass
class Timings:
    """Wall time of the plugin's own work per step, microseconds; the last TIMINGS_KEPT steps only, so a
    long-running server does not grow them without bound."""

    agree_us: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))   # the agreement
    load_us: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))    # load in and out
    plugin_us: deque[float] = field(default_factory=lambda: deque(maxlen=TIMINGS_KEPT))  # all but vLLM's step

    def medians(self) -> dict[str, float]:
        return {k: float(np.median(v)) if v else 0.0 for k, v in (("agree_us", self.agree_us),
                                                                  ("load_us", self.load_us),
                                                                  ("plugin_us", self.plugin_us))}


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
        self.is_async = bool(eplb_state.is_async)
        policy_name = getattr(eplb_state.parallel_config.eplb_config, "policy", "default")
        if policy_name != "default":
            log.warning("eplb_config.policy=%r is replaced by the agents' tables: the policy is not used",
                        policy_name)
        L, E, S = int(model.num_moe_layers), int(model.num_logical_experts), int(model.num_local_physical_experts)
        self.topo = Topology(1, G, S)
        if link is None:
            from dataplane_shim.link import LinkThread

            link = LinkThread(settings.socket.replace("{rank}", str(self.rank)), 1, shim_id=f"vllm-ep{self.rank}",
                              ranks=[self.rank])
        self.link = link
        boot = self.ms.physical_to_logical_map.detach().cpu().numpy()
        self.core = PluginCore(link, self.topo, L, E, self.rank, boot, genesis=settings.genesis,
                               report_every=settings.report_every, shim_id=f"vllm-ep{self.rank}",
                               sample_every=settings.sample_every, max_batch_tokens=batch_tokens(eplb_state))
        self.inst = Installer(self.core, agree_every=settings.agree_every,
                              stall_steps=settings.stall_steps or max(256, 8 * L), rank=self.rank)
        self.E = E
        dev = self.ms.expert_load_pass.device
        self._scratch = torch.zeros(L, E + 1, dtype=torch.int64, device=dev)
        self._acc_steps = 0  # steps of load not yet folded
        self._last_t0: float | None = None  # when the hook last ran (a step's wall time: the time between two)
        # The load source. While its counter is held at interval - 2 (`_hold`), vLLM records expert_load_pass
        # into its own sliding window (a ring of window_size steps) and zeroes it at every step. When that ring
        # holds more steps than a report, the ring is the accumulator: no per-step work at all, one sum over
        # the new slots per report. Otherwise (vLLM's window of 1 or 2 steps) the plugin adds expert_load_pass
        # to its own accumulator before vLLM's step, and zeroes it itself where vLLM does not record.
        self._window = int(eplb_state.expert_load_window_size)
        self._ring = self._window > settings.report_every
        self._ring_from = int(eplb_state.expert_load_window_step)  # the first slot not yet folded
        self._acc = (None if self._ring else
                     torch.zeros(tuple(self.ms.expert_load_pass.shape), dtype=torch.int64, device=dev))  # [L, P]
        self._zero_pass = self._window < 2
        self._acc_rows: list[torch.Tensor] = []  # the accumulator's sampled steps' physical load [L, P] each
        # expert_load_pass -> logical index ([L, P], empty slots -> E): rebuilt after a step that may have moved
        self._idx: torch.Tensor | None = None
        self.target: torch.Tensor | None = None  # the armed table's phy2log, what the policy returns
        self.timings = Timings()
        store = default_store() if G > 1 else None
        self.watch = (PeerWatch(store, self.rank, G, prefix=f"elasticmoe/{getattr(ep, 'unique_name', 'ep')}")
                      if store is not None else None)
        self.lost_peers: list[int] = []  # named by the last failed collective
        self._agreeing: tuple[Any, torch.Tensor] | None = None  # the agreement all-reduce in flight, its buffer
        self._check_schedule(settings.agree_every)
        plugin = self

        class ElasticMoePolicy(AbstractEplbPolicy):  # type: ignore[misc]
            """vLLM's policy hook: the armed table's phy2log (the current map when none is armed)."""

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
        """Called by vLLM's `rearrange()` (sync) or its async worker thread: reads only `self.target`, which
        the main thread sets before the rearrangement starts and clears after vLLM reports it done."""
        if num_replicas != self.topo.slots or num_ranks != self.topo.ranks:
            raise BadInput(f"vLLM asks for {num_replicas} slots on {num_ranks} ranks: the plugin attached to "
                           f"{self.topo.slots} slots on {self.topo.ranks} ranks")
        target = self.target
        if target is not None:
            return target.clone()
        current = self.ms.physical_to_logical_map if old is None else old
        return current.detach().cpu().clone()

    def step(self, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> None:
        if is_profile:  # vLLM's memory profiling: a dummy rearrange; the policy returns the current map
            self._orig_step(is_dummy=is_dummy, is_profile=True, log_stats=log_stats)
            self._idx, self._last_t0 = None, None
            return
        inst = self.inst
        t0 = time.perf_counter()
        table = inst.begin_step(self)  # the agreements (this plugin is the Collective), then the table to arm
        t1 = time.perf_counter()
        if table is not None:
            self._arm(table)
        remap = inst.inflight is not None  # the map may change in this step: what it records folds under the old
        if remap and self._idx is None:
            self._index()
        if not is_dummy:
            if self._last_t0 is not None:  # the pass just recorded ran between the last hook call and this one
                self.core.step_took(self._acc_steps, (t0 - self._last_t0) * 1e6)
            if self._acc is not None:
                self._acc += self.ms.expert_load_pass  # before vLLM records (and zeroes) it
                if self.core.is_sampled(self._acc_steps):
                    self._acc_rows.append(self.ms.expert_load_pass.clone())
            self._acc_steps += 1
        t2 = time.perf_counter()
        self._orig_step(is_dummy=is_dummy, is_profile=False, log_stats=log_stats)
        t3 = time.perf_counter()
        if self._zero_pass:
            self.ms.expert_load_pass.zero_()
        if self._acc_steps and (remap or self._acc_steps + self.core.steps_pending >= self.core.report_every
                                or self._acc_steps >= self._window - 1):  # (vLLM's ring never wraps unread)
            self._flush()
        t4 = time.perf_counter()
        if remap:
            self._idx = None
            moving = self.is_async and bool(self.ms.rebalanced)
            matched = (not moving and self.target is not None
                       and torch.equal(self.ms.physical_to_logical_map.cpu(), self.target))
            inst.after_step(moving=moving, matched=matched)
            if inst.inflight is None:
                self.target = None
        else:
            inst.after_step(moving=False, matched=False)
        self._hold()
        t5 = time.perf_counter()
        self._last_t0 = None if is_dummy else t0
        self.timings.load_us.append((t4 - t3) * 1e6)
        self.timings.agree_us.append((t1 - t0) * 1e6)
        self.timings.plugin_us.append((t2 - t0 + t5 - t3) * 1e6)

    def install_status(self) -> dict[str, Any]:
        """Installed version, what is in flight or queued, stalls and failures (`Installer.status`), and vLLM's
        own view: `rebalanced` (its worker still moving) and the mode."""
        return {**self.inst.status(), "async": self.is_async, "vllm_moving": bool(self.ms.rebalanced)}

    # ---- pieces ----------------------------------------------------------------------------------
    def _arm(self, table: RoutingTable) -> None:
        """Hand `table` to vLLM at this step, on every rank alike."""
        from vllm.platforms import current_platform

        self.target = torch.from_numpy(np.array(table.phy2log))
        if not self.is_async and current_platform.is_rocm():
            self._install_direct(self.target)
        else:
            self.es.expert_rearrangement_step = self.interval - 1  # vLLM's step increments and rearranges

    def _install_direct(self, new: torch.Tensor) -> None:
        """vLLM's sync `rearrange()` less its load all-reduce and its ROCm 5% gain rule: its weight mover, then
        its map commit (the two calls it makes when it does not skip)."""
        from vllm.distributed.eplb.eplb_state import _commit_eplb_maps
        from vllm.distributed.eplb.rebalance_execute import rearrange_expert_weights_inplace
        from vllm.distributed.parallel_state import get_ep_group

        ms = self.ms
        rearrange_expert_weights_inplace(ms.physical_to_logical_map, new, ms.model.expert_weights, ms.expert_buffer,
                                         get_ep_group().device_group, ms.communicator)
        _commit_eplb_maps(ms, new_physical_to_logical_map=new)

    def _hold(self) -> None:
        """Keep vLLM's periodic rearrange from firing (one step short of the interval); after vLLM reset its
        counter (it rearranged), set its layers recording load again."""
        if self.es.expert_rearrangement_step != self.interval - 1 and self.es.should_record_tensor is not None:
            self.es.should_record_tensor.fill_(True)
        self.es.expert_rearrangement_step = self.interval - 2

    def _index(self) -> torch.Tensor:
        """expert_load_pass -> logical index ([L, P], empty slots -> E) under the current map."""
        p2l = self.ms.physical_to_logical_map
        self._idx = p2l.masked_fill(p2l < 0, self.E).long()
        return self._idx

    def _flush(self) -> None:
        """Fold the physical load [L, P] of the steps since the last fold (vLLM's ring slots, or the plugin's
        accumulator) to logical [L, E] through the map they ran under (`_idx`, kept from before a step that
        may change it), hand it to the core (one device-to-host copy) and offer a report if `report_every`
        steps are in."""
        idx = self._idx if self._idx is not None else self._index()
        steps = self._acc_steps
        if self._acc is not None:
            load, rows = self._acc, self._acc_rows
        else:  # vLLM's ring: the slots it wrote since the last fold (fewer than window_size: see __init__)
            ring, cur = self.ms.expert_load_window, int(self.es.expert_load_window_step)
            steps = (cur - self._ring_from) % self._window
            if self._ring_from + steps <= self._window:
                load = ring[self._ring_from:self._ring_from + steps].sum(0)
            else:
                load = ring[self._ring_from:].sum(0) + ring[:cur].sum(0)
            rows = [ring[(self._ring_from + o) % self._window] for o in self.core.sampled(steps)]
            self._ring_from = cur
        if steps:
            self._scratch.zero_()
            self._scratch.scatter_add_(1, idx, load.to(torch.int64))
            folded = None
            if rows:  # the sampled steps, folded to logical the same way (one batched scatter, one copy)
                per = torch.zeros(len(rows), *self._scratch.shape, dtype=torch.int64, device=self._scratch.device)
                per.scatter_add_(2, idx.expand(len(rows), *idx.shape), torch.stack(rows).to(torch.int64))
                folded = per[:, :, : self.E].cpu().numpy()
            elif self.core.sample_every:
                folded = np.zeros((0, *self._scratch[:, : self.E].shape), np.int64)
            self.core.add_load(self._scratch[:, : self.E].cpu().numpy(), steps, folded)
        if self._acc is not None:
            self._acc.zero_()
        self._acc_rows = []
        self._acc_steps = 0
        self.core.maybe_report()

    def _check_schedule(self, every: int) -> None:
        if self.topo.ranks > 1:
            check_agree_every(every, self._reduce_min, self.rank)

    def _reduce_min(self, vec: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.int64))
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return t.numpy()

    # ---- the agreement's collective (dataplane_shim.agreement.Collective) -------------------------
    def start_agreement(self, vector: npt.NDArray[np.int64]) -> npt.NDArray[np.int64] | None:
        """Start one agreement of the schedule, overlapped with the engine's step: the MIN all-reduce runs in
        gloo's worker thread during this step (the forward passes' collectives use the device group, not this
        one), and `take_agreement` takes its result at the next step. Every rank takes the same result at the
        same step, so the schedule stays in lockstep; a version waits at most K steps for its agreement (from
        its arrival just after one agreement step to the step after the next). A group of one: done at once."""
        vec = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.int64))
        if self.topo.ranks < 2:
            return _ints(vec)
        try:
            work = torch.distributed.all_reduce(vec, op=torch.distributed.ReduceOp.MIN, group=self.group,
                                                async_op=True)
        except RuntimeError:
            self.peer_failure()
            raise  # the EP group is broken: vLLM's own failure handling takes it from here
        work.get_future().add_done_callback(self._agreement_done)
        self._agreeing = (work, vec)
        return None

    def take_agreement(self) -> npt.NDArray[np.int64] | None:
        """The agreement started at the previous step: done by now (a few int64 over gloo, against a whole
        engine step), taken on every rank at this same step."""
        if self._agreeing is None:
            return None
        work, buf = self._agreeing
        self._agreeing = None
        try:
            work.wait()
        except RuntimeError:
            self.peer_failure()
            raise
        return _ints(buf)

    def _agreement_done(self, fut: Any) -> None:
        """In gloo's thread, as an agreement completes: a failed one names the lost peers to the agent at once,
        not at the next agreement step (which a forward hung on the dead peer may never reach)."""
        try:
            fut.value()
        except Exception:  # the EP group broke under it
            self.peer_failure()

    def peer_failure(self) -> list[int]:
        """A collective of the EP group failed: name the peers that stopped beating and tell the agent at once
        (Lifeguard's local evidence: it suspects their nodes without waiting for its own probes)."""
        lost = self.watch.unreachable() if self.watch is not None else []
        for r in lost:
            self.core.peer_unreachable(r)
        if lost:
            log.warning("rank %d: EP collective failed; ranks %s stopped responding: reported to the agent",
                        self.rank, lost)
            self.core.report_evidence()
        self.lost_peers = lost  # set once the agent has been told (an engine that exits on it loses nothing)
        return lost

    def close(self) -> None:
        self.es.step = self._orig_step
        if self._agreeing is not None:  # its peers entered it too: let it finish, as they do
            work, self._agreeing = self._agreeing[0], None
            try:
                work.wait()
            except RuntimeError:
                log.warning("rank %d: the last agreement failed at close", self.rank)
        if self.watch is not None:
            self.watch.close()
        close = getattr(self.link, "close", None)
        if close is not None:
            close()


def _ints(t: torch.Tensor) -> npt.NDArray[np.int64]:
    return np.asarray(t.numpy(), dtype=np.int64)


def batch_tokens(eplb_state: Any) -> int:
    """The most tokens one step carries into a rank's expert_load_pass, what its reports declare: the
    scheduler's max_num_batched_tokens x data_parallel_size (a rank's MoE layers may count the tokens every DP
    rank gathered to it); 0 where no vLLM config is current (vLLM builds the EPLB state inside one)."""
    from vllm.config import get_current_vllm_config_or_none

    vc = get_current_vllm_config_or_none()
    if vc is None or not vc.scheduler_config.max_num_batched_tokens:
        return 0
    return int(vc.scheduler_config.max_num_batched_tokens) * max(1, int(eplb_state.parallel_config.data_parallel_size))


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
    engine_version.check("vllm")  # another vLLM than the tested one: refused here (vLLM lets it propagate)
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
