"""The operator's path into the decision core (Admin Propose, Drain, Restore, Pause; a rank back on the local
link or after its repair is restored the same way): the operations go through the controller's manual event,
so that what it refuses is refused with its own reason (agent.decision.pipeline.DecisionPipeline.manual: its Ready is
consumed, counted and proposed by the pipeline's one consumer, `perform`, as an automatic one is), and the
node's proposal is awaited. Pause and Resume write the cluster's pause switch (agent.commit.PauseSwitch: a
record committed by a quorum apart from the tables), which every node's pipeline follows. A restore that
commits is followed at once by the controller's proposal of experts for the rank (controlplane.restore), which
`restore` awaits too. One object, built complete once the pipeline exists (agent.state.NodeState)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from agent.clock import Clock
from agent.commit import CommitBackend, PauseSwitch
from agent.consensus.controlnode import ControlOutcome
from agent.decision.pipeline import DecisionPipeline
from controlplane.elastic import DrainRefused, plan_drain, plan_restore
from controlplane.errors import ControlPlaneError
from controlplane.ops import Operation, apply_ops
from controlplane.table import RoutingTable
from elasticmoe.v1 import admin_pb2 as apb


class ManualPath:
    """The operator's steering (pause, drain, restore, a forced rebalance); a drain places the drained experts
    by the pipeline's newest closed cluster window."""

    def __init__(self, pipeline: DecisionPipeline, backend: CommitBackend, switch: PauseSwitch, clock: Clock) -> None:
        self.pipeline, self.backend, self.switch, self.clock = pipeline, backend, switch, clock

    @property
    def paused(self) -> bool:
        """Whether the cluster's switch, as this node knows it, pauses automatic rebalancing."""
        return self.pipeline.paused

    async def set_paused(self, paused: bool, admin: str = "", limit_s: float = 20.0) -> apb.AdminAck:
        """Commit a pause (or resume) record by quorum, for `admin` (the operator who asked this node; "": not
        known); the ack says who holds it, or why it did not commit (a node cut off from a quorum of the voters
        cannot commit one: its error names who did not answer). A node that may not vote yet (a new cluster's
        voters enrol first; a learner catching up) is waited for, up to half of `limit_s`, before it writes: an
        operator pausing a cluster that just started is not refused for that."""
        await self._until(lambda: not self.switch.unready(), limit_s / 2)
        fut: asyncio.Future[ControlOutcome] = asyncio.get_running_loop().create_future()
        self.switch.write(paused, "emoe pause" if paused else "emoe resume",
                          lambda o: None if fut.done() else fut.set_result(o), admin)
        try:
            o = await asyncio.wait_for(fut, timeout=limit_s)
        except TimeoutError:
            o = ControlOutcome(False, None, f"no outcome within {limit_s:.0f} s")
        what = "paused" if paused else "resumed"
        if not o.committed or o.commit is None:
            return apb.AdminAck(ok=False, reason=f"automatic rebalancing not {what}: {o.reason}",
                                version=self.head().version)
        r = o.commit.record
        return apb.AdminAck(ok=True, version=self.head().version,
                            reason=f"automatic rebalancing {what} cluster-wide (pause record {r.seq}, by {r.node_id}"
                                   f"{f' for admin {r.admin}' if r.admin else ''}, committed by "
                                   f"{', '.join(o.commit.voters)})")

    def head(self) -> RoutingTable:
        return self.backend.head

    async def _settled(self, limit_s: float = 10.0, poll_s: float = 0.05) -> None:
        """Wait, at most `limit_s` on this node's clock, until this node has no proposal in flight: an operator's
        drain or proposal made while a rebalance awaits its outcome is planned on the head that outcome leaves
        (was refused at once, PROPOSAL_IN_FLIGHT). Past the limit the controller refuses it with its reason."""
        await self._until(lambda: self.pipeline.inflight is None, limit_s, poll_s)

    async def _until(self, done: Callable[[], bool], limit_s: float, poll_s: float = 0.05) -> None:
        """Poll `done` on this node's clock until it holds or `limit_s` passed."""
        t0 = self.clock.now()
        while not done() and self.clock.now() - t0 < limit_s:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.clock.call_later(poll_s, _resolver(fut))
            await fut

    async def _submit(self, ops: tuple[Operation, ...], trigger: str, force: bool) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        d, why = self.pipeline.manual(ops, trigger, force, done=fut)  # proposed there, its outcome set on fut
        if d is None:
            return None, why
        return await asyncio.wait_for(fut, timeout=20.0), ""

    def restore_now(self, rank: int) -> str:
        """Propose the restore of `rank` without waiting for its outcome (agent.decision.rejoin watches the commits);
        "" or why it was refused."""
        try:
            ops = plan_restore(self.head(), rank)
        except DrainRefused as e:
            return str(e)
        return self.pipeline.manual(ops, f"restore r{rank}", True, f"rank {rank} is back after its repair (rejoin)")[1]

    async def propose_manual(self, ops: tuple[Operation, ...], force: bool) -> apb.ProposeReply:
        await self._settled()
        try:
            apply_ops(self.head(), ops).validate()
        except ControlPlaneError as e:
            return apb.ProposeReply(committed=False, reason=str(e))
        outcome, why = await self._submit(ops, "manual", force)
        if outcome is None:
            return apb.ProposeReply(committed=False, reason=why)
        return apb.ProposeReply(committed=bool(outcome.committed), version=int(outcome.version),
                                reason=str(outcome.reason or ""))

    async def _elastic(self, ops_fn: Callable[[], tuple[Operation, ...]], what: str) -> apb.AdminAck:
        await self._settled()
        try:
            ops = ops_fn()
        except DrainRefused as e:
            return apb.AdminAck(ok=False, reason=str(e), version=self.head().version)
        outcome, why = await self._submit(ops, what, True)
        if outcome is None:
            return apb.AdminAck(ok=False, reason=why, version=self.head().version)
        return apb.AdminAck(ok=bool(outcome.committed), reason=str(outcome.reason or what), version=int(outcome.version))

    async def drain(self, rank: int) -> apb.AdminAck:
        return await self._elastic(lambda: plan_drain(self.head(), rank, self.pipeline.latest_window()), f"drain r{rank}")

    async def restore(self, rank: int) -> apb.AdminAck:
        """Return `rank` to service, then await the experts the controller proposes for it as the restore
        commits; the answer names the version that put them there, or why there is none (the rank is active
        either way: a later rebalance fills it)."""
        ack = await self._elastic(lambda: plan_restore(self.head(), rank), f"restore r{rank}")
        if not ack.ok:
            return ack
        v = int(ack.version)
        await self._until(lambda: self.pipeline.fill_after(v) is not None, 5.0)
        found = self.pipeline.fill_after(v)
        why = found[1] if found is not None else "none proposed"
        if found is not None and found[0] is not None:  # the fill (and a retry, if it lost its version) is decided
            await self._until(lambda: self.pipeline.inflight is None and self.pipeline.computing() != "fill", 30.0)
            found = self.pipeline.fill_after(v)
            if found is not None and found[0] is not None:
                rec = self.pipeline.explains.get(found[0].table.version)
                why = rec.outcome if rec is not None else found[1]
        head = self.head()
        topo = head.topology
        held = int((head.phy2log.reshape(head.layers, topo.ranks, -1)[:, rank] >= 0).sum())
        if held and rank in head.active_ranks:
            return apb.AdminAck(ok=True, version=head.version,
                                reason=f"restore r{rank} in v{v}, then {held} experts on it in v{head.version}")
        return apb.AdminAck(ok=True, version=v, reason=f"restore r{rank} in v{v}; no experts on it yet ({why}): a "
                                                        f"later rebalance fills it")


def _resolver(fut: asyncio.Future[None]) -> Callable[[], None]:
    def fire() -> None:
        if not fut.done():
            fut.set_result(None)

    return fire
