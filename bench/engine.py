"""Reference expert-parallel engine: replays a counts trace through a routing table, one simulated EP
engine per rank, with a step-time model for the MoE part of a decode step, and charges weight movement.

Step-time model, per MoE layer and rank g (all figures per GPU; H200 SXM):
- expert GEMMs (grouped, gate/up/down): compute time = 2 x 3 x hidden x inter x tokens_g / (peak x eff),
  memory time = (active slots x expert weight bytes + tokens_g x activation bytes) / (HBM x eff);
  a grouped GEMM runs at the slower of the two (roofline).
- all-to-all dispatch + combine: every token-expert pair that lands on g carries `hidden` activations in
  and out. Tokens are spread evenly over ranks before dispatch (data-parallel attention), so a fraction
  1/G of g's pairs is local, (ranks_per_node - 1)/G comes over NVLink and the rest over InfiniBand; the
  receive time is the slower of the two links.
- layer time on g = GEMM + all-to-all; a layer waits for its slowest rank; the MoE part of a step is the
  sum over MoE layers.
- the rest of the step (`ModelShape.other_ms`, the same for every policy and every rank: it changes no
  comparison, but it converts seconds into steps: detection delays, copy times): data-parallel attention
  with B / G sequences per rank, each layer a roofline of its weights and its KV-cache reads
  (B / G x `context` tokens x the latent KV bytes) against FLOPs 2 x params + 4 x context x heads x latent
  per sequence; the dense layers' MLPs, the shared experts of each MoE layer and the LM head read their
  weights once per step (decode: memory-bound). Not modelled: norms, rotary, sampling, the CPU side,
  kernel launch gaps (CUDA graphs hide most), and MTP. DeepSeek-V3 at B = 4096 over 64 ranks and a 2k
  context: ~7 ms per step besides the ~23 ms MoE part.

H200 figures (sources):
- 989 TFLOP/s dense BF16 (NVIDIA H200 datasheet, "BF16 Tensor Core 1,979 TFLOPS with sparsity"), 1979 for
  FP8 dense (3,958 with sparsity);
- 4.8 TB/s HBM3e (H200 datasheet, 141 GB at 4.8 TB/s);
- NVLink 4: 900 GB/s per GPU aggregate bidirectional (H200 datasheet) -> 450 GB/s per direction;
- 400 Gb/s InfiniBand per GPU (ConnectX-7 NDR, one NIC per GPU in DGX/HGX H200) -> 50 GB/s;
- achieved fractions: ~60% of peak for grouped decode GEMMs and ~80% of HBM bandwidth (DeepGEMM reports
  1,300-1,500 FP8 TFLOP/s of 1,979 on H800 for large shapes and less for decode shapes; STREAM-like copies
  reach 80-90% of HBM peak); DeepEP reports ~150 GB/s NVLink and ~45 GB/s RDMA for low-latency kernels.
Weight copies use the topology's tier bandwidths (controlplane.topology, effective point-to-point).

Routing (default `ShimRouter`): the shim's router policy (dataplane_shim.router: each sender sends the
i-th token of expert e in a step to the (i mod logcnt)-th replica of e in its preference order, nearest
first) applied in closed form to counts: a trace gives tokens per expert per step, not per sender, so each
expert's tokens are spread evenly over the G senders (data-parallel attention over a shuffled batch), the
first c mod G senders taking one more. `even_split` (controlplane.load's split, remainders to the
lowest-numbered replicas) is the alternative the decision core's replay uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from controlplane.load import slot_load
from controlplane.table import RoutingTable
from controlplane.topology import Tier, Topology

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Router = Callable[[RoutingTable, npt.NDArray[np.integer]], I64]


@dataclass(frozen=True)
class ModelShape:
    """The MoE dimensions the step model needs. weight_bytes: bytes per expert parameter."""

    name: str
    hidden: int
    inter: int
    top_k: int
    weight_bytes: float = 2.0  # bf16
    act_bytes: float = 2.0  # bf16 activations on the wire and in HBM
    fp8: bool = False
    # the rest of the step (0: not modelled): all transformer layers, attention params per layer, heads and
    # the latent KV width (MLA: kv_lora_rank + rope dim), dense-MLP params of each of `dense_layers`, shared
    # expert params per MoE layer, LM head params (served in bf16)
    layers_total: int = 0
    attn_params: float = 0.0
    heads: int = 0
    kv_latent: int = 0
    dense_layers: int = 0
    dense_params: float = 0.0
    shared_params: float = 0.0
    head_params: float = 0.0

    @property
    def expert_bytes(self) -> float:
        """Bytes of one expert's gate, up and down projections."""
        return 3.0 * self.hidden * self.inter * self.weight_bytes

    def other_ms(self, hw: Hardware, seqs_per_rank: F64, context: int) -> F64:
        """Milliseconds of a decode step outside the routed experts, per step, for `seqs_per_rank` [T]."""
        n = np.asarray(seqs_per_rank, dtype=np.float64)
        peak = (hw.fp8_flops if self.fp8 else hw.bf16_flops) * hw.compute_eff
        bw = hw.hbm * hw.hbm_eff
        kv = n * context * self.kv_latent * self.act_bytes  # KV-cache bytes read per layer
        attn = np.maximum((2.0 * self.attn_params + 4.0 * context * self.heads * self.kv_latent) * n / peak,
                          (self.attn_params * self.weight_bytes + kv) / bw)
        moe_layers = self.layers_total - self.dense_layers
        weights = (self.dense_layers * self.dense_params + moe_layers * self.shared_params) * self.weight_bytes
        rest = np.maximum(2.0 * n * (self.dense_layers * self.dense_params + moe_layers * self.shared_params) / peak,
                          weights / bw)
        head = np.maximum(2.0 * n * self.head_params / (hw.bf16_flops * hw.compute_eff),
                          self.head_params * 2.0 / bw)
        out: F64 = (self.layers_total * attn + rest + head) * 1e3
        return out


# DeepSeek-V2-Lite (ESFT-vanilla-lite): hidden 2048, moe_intermediate_size 1408, 64 routed experts, top-6,
# 26 MoE layers (config.json of deepseek-ai/DeepSeek-V2-Lite); served in bf16.
# Attention (MLA, no q LoRA): q 2048 x 16 x 192, kv_a 2048 x 576, kv_b 512 x 16 x 256, o 16 x 128 x 2048
# (13.8 M); 27 layers, the first dense (intermediate 10944); 2 shared experts; vocab 102400.
DEEPSEEK_V2_LITE = ModelShape("deepseek-v2-lite", hidden=2048, inter=1408, top_k=6, layers_total=27,
                              attn_params=13.8e6, heads=16, kv_latent=576, dense_layers=1,
                              dense_params=3 * 2048 * 10944, shared_params=2 * 3 * 2048 * 1408,
                              head_params=102400 * 2048)
# DeepSeek-V3: hidden 7168, moe_intermediate_size 2048, 256 routed experts, top-8, 58 MoE layers; FP8 weights.
# Attention (MLA): q_a 7168 x 1536, q_b 1536 x 128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256, o 128 x 128 x
# 7168 (187 M); 61 layers, the first 3 dense (intermediate 18432); 1 shared expert; vocab 129280.
DEEPSEEK_V3 = ModelShape("deepseek-v3", hidden=7168, inter=2048, top_k=8, weight_bytes=1.0, fp8=True,
                         layers_total=61, attn_params=187e6, heads=128, kv_latent=576, dense_layers=3,
                         dense_params=3 * 7168 * 18432, shared_params=3 * 7168 * 2048, head_params=129280 * 7168)


def shape_for(layers: int, experts: int, top_k: int) -> ModelShape:
    """The preset matching a trace's [L, E] (V3 for 256 experts, else V2-Lite dimensions with its top-k)."""
    if experts == 256:
        return DEEPSEEK_V3
    if (layers, experts) == (26, 64):
        return DEEPSEEK_V2_LITE
    k = top_k if top_k > 0 else DEEPSEEK_V2_LITE.top_k
    return ModelShape(f"generic-{layers}x{experts}", DEEPSEEK_V2_LITE.hidden, DEEPSEEK_V2_LITE.inter, k)


@dataclass(frozen=True)
class Hardware:
    """Per-GPU figures (H200 SXM by default; sources in the module docstring)."""

    bf16_flops: float = 989e12
    fp8_flops: float = 1979e12
    hbm: float = 4.8e12
    nvlink: float = 450e9  # per direction (900 GB/s aggregate bidirectional)
    ib: float = 50e9  # 400 Gb/s
    compute_eff: float = 0.6
    hbm_eff: float = 0.8
    nvlink_eff: float = 0.33  # DeepEP low-latency kernels: ~150 GB/s of 450
    ib_eff: float = 0.9  # DeepEP: ~45 GB/s of 50


H200 = Hardware()


def even_split(table: RoutingTable, counts: npt.NDArray[np.integer]) -> I64:
    """Default router: counts [T, L, E] -> tokens per slot [T, L, P] (controlplane.load's even split)."""
    return slot_load(table, counts)


class ShimRouter:
    """The shim router's policy on counts, in closed form.

    Sender s holds n_s = c // G + (s < c mod G) tokens of an expert with r replicas; its i-th token goes to
    the (i mod r)-th replica of its preference order, so the replica at position j of s's order gets
    n_s // r + (j < n_s mod r). Summed over senders with a per-table prefix count
    cum [G + 1, L, P, R] = #{s' < s : j_s'(p) < v} (cached by table digest), nothing loops over senders
    per step.
    """

    label = "dataplane_shim.router policy (closed form on counts, senders even)"

    def __init__(self) -> None:
        self._cache: dict[bytes, npt.NDArray[np.uint16]] = {}

    def prefix_counts(self, table: RoutingTable) -> npt.NDArray[np.uint16]:
        """[G + 1, L, P, R]: senders before s for which slot p is among its expert's first v replicas."""
        key = table.digest
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        from dataplane_shim.router import preference_order

        L, P = table.phy2log.shape
        G = table.topology.ranks
        R = max(1, int(table.logcnt.max(initial=1)))
        cum = np.zeros((G + 1, L, P, R), dtype=np.uint16)
        v = np.arange(R)
        for s in range(G):  # G senders, once per table, each vectorised over layers and slots
            pref = preference_order(table, s)  # [L, E, W]
            j = np.full((L, P), R, dtype=np.int64)
            li, ei, wi = np.nonzero(pref >= 0)
            j[li, pref[li, ei, wi]] = wi
            cum[s + 1] = cum[s] + (j[..., None] < v)
        if len(self._cache) > 8:
            self._cache.clear()
        self._cache[key] = cum
        return cum

    def __call__(self, table: RoutingTable, counts: npt.NDArray[np.integer]) -> I64:
        """counts [T, L, E] -> tokens per slot [T, L, P]."""
        cum = self.prefix_counts(table)
        G = table.topology.ranks
        phy = table.phy2log
        valid = phy >= 0
        e = np.where(valid, phy, 0)
        layer = np.broadcast_to(np.arange(table.layers)[:, None], phy.shape)
        slot = np.broadcast_to(np.arange(phy.shape[1])[None, :], phy.shape)
        c = np.asarray(counts, dtype=np.int64)[:, layer, e]  # [T, L, P] tokens of each slot's expert
        r = np.where(valid, table.logcnt[layer, e], 1)  # [L, P]
        q, m = c // G, c % G
        rem_a, rem_b = (q + 1) % r, q % r
        out = m * ((q + 1) // r) + (G - m) * (q // r)
        out += cum[m, layer, slot, rem_a]
        out += cum[G, layer, slot, rem_b]
        out -= cum[m, layer, slot, rem_b]
        return np.where(valid, out, 0)


class RankEngine:
    """The simulated EP engine of one rank: its slots' tokens -> per-layer time."""

    def __init__(self, rank: int, topo: Topology, shape: ModelShape, hw: Hardware) -> None:
        self.rank = rank
        G, R = topo.ranks, topo.ranks_per_node
        self.frac_nvlink = (R - 1) / G
        self.frac_ib = (G - R) / G
        self.shape = shape
        self.hw = hw

    def layer_ms(self, slot_tokens: I64, link_scale: tuple[float, float] = (1.0, 1.0)) -> F64:
        """slot_tokens: [T, L, S] tokens on this rank's slots -> [T, L] milliseconds.

        link_scale: the fraction of (NVLink, IB) receive bandwidth left to the all-to-all (copies in
        flight take the rest)."""
        m, hw = self.shape, self.hw
        tok = slot_tokens.sum(axis=-1).astype(np.float64)
        active = (slot_tokens > 0).sum(axis=-1).astype(np.float64)
        peak = hw.fp8_flops if m.fp8 else hw.bf16_flops
        t_compute = 6.0 * m.hidden * m.inter * tok / (peak * hw.compute_eff)
        hbm_bytes = active * m.expert_bytes + tok * (2 * m.hidden + 3 * m.inter) * m.act_bytes
        t_mem = hbm_bytes / (hw.hbm * hw.hbm_eff)
        wire = 2.0 * tok * m.hidden * m.act_bytes  # dispatch in + combine out
        t_nv = wire * self.frac_nvlink / (hw.nvlink * hw.nvlink_eff * link_scale[0])
        t_ib = wire * self.frac_ib / (hw.ib * hw.ib_eff * link_scale[1])
        out: F64 = (np.maximum(t_compute, t_mem) + np.maximum(t_nv, t_ib)) * 1e3
        return out


@dataclass
class StepResult:
    """step_ms [T] (the whole decode step: MoE part plus ModelShape.other_ms), imbalance [T] (step imbalance of live ranks' tokens);
    lost [T, L, E]: pairs routed to dead ranks' slots, per expert (None without dead ranks)."""

    step_ms: F64
    imbalance: F64
    lost: I64 | None = None


def lost_by_expert(table: RoutingTable, slot_tokens: npt.NDArray[np.integer], dead: npt.NDArray[np.bool_]) -> I64:
    """Pairs routed to dead ranks' slots, per expert. slot_tokens [T, L, P], dead [G] -> [T, L, E]."""
    out = np.zeros((slot_tokens.shape[0], table.layers, table.experts), dtype=np.int64)
    li, pi = np.nonzero((table.phy2log >= 0) & np.repeat(dead, table.topology.slots_per_rank)[None, :])
    if li.size:  # [L * E, T] view of out: one scatter-add over the dead slots, vectorised over steps
        flat = out.reshape(out.shape[0], -1).T
        np.add.at(flat, li * table.experts + table.phy2log[li, pi], np.asarray(slot_tokens[:, li, pi], dtype=np.int64).T)
    return out


@dataclass
class Moves:
    """Weight copies that turn one table into another. bytes_to [G, 4]: bytes each rank receives per tier
    (Tier order: same rank, same node, other node, host)."""

    copies: int
    bytes_total: float
    bytes_to: F64


class EPCluster:
    """G rank engines behind one router; replays counts through a table and prices table changes."""

    def __init__(self, topo: Topology, shape: ModelShape, hw: Hardware = H200, router: Router | None = None,
                 context: int = 2048) -> None:
        self.topo = topo
        self.shape = shape
        self.hw = hw
        self.context = context  # mean KV length of the sequences in a decode batch
        self.router: Router = ShimRouter() if router is None else router
        self.ranks = [RankEngine(g, topo, shape, hw) for g in range(topo.ranks)]

    def run(
        self, table: RoutingTable, counts: npt.NDArray[np.integer], link_scale: F64 | None = None,
        dead: npt.NDArray[np.bool_] | None = None,
    ) -> StepResult:
        """counts [T, L, E] under `table` -> StepResult. link_scale: [G, 2] bandwidth left per rank and link;
        dead [G]: ranks that serve nothing (left out of time and imbalance; their pairs counted as lost)."""
        S = self.topo.slots_per_rank
        slots = self.router(table, counts)  # [T, L, P]
        T, L, _ = slots.shape
        per_rank = slots.reshape(T, L, self.topo.ranks, S)
        times = np.empty((T, L, self.topo.ranks), dtype=np.float64)
        for g, eng in enumerate(self.ranks):  # one engine per rank, each vectorised over steps and layers
            scale = (1.0, 1.0) if link_scale is None else (float(link_scale[g, 0]), float(link_scale[g, 1]))
            times[:, :, g] = eng.layer_ms(per_rank[:, :, g, :], scale)
        act = table.active_mask if dead is None else table.active_mask & ~dead
        step_ms = times[:, :, act].max(axis=2).sum(axis=1)
        if self.shape.layers_total:  # the rest of the step: B / G sequences per live rank
            seqs = np.asarray(counts, dtype=np.float64)[:, 0, :].sum(axis=1) / max(self.shape.top_k, 1)
            step_ms = step_ms + self.shape.other_ms(self.hw, seqs / max(int(act.sum()), 1), self.context)
        tok = per_rank.sum(axis=3)[:, :, act]
        mx = tok.max(axis=2).sum(axis=1).astype(np.float64)
        mean = tok.mean(axis=2).sum(axis=1)
        imb = np.divide(mx, mean, out=np.ones_like(mx), where=mean > 0)
        lost = None if dead is None or not dead.any() else lost_by_expert(table, slots, dead)
        return StepResult(step_ms, imb, lost)

    def moe_ms(self, table: RoutingTable, counts: npt.NDArray[np.integer]) -> F64:
        """The MoE part of each step of `counts` [T, L, E] under `table` (every layer waits for its slowest rank),
        without copies in flight: [T] milliseconds."""
        S = self.topo.slots_per_rank
        per_rank = self.router(table, counts).reshape(counts.shape[0], counts.shape[1], self.topo.ranks, S)
        times = np.stack([eng.layer_ms(per_rank[:, :, g, :], (1.0, 1.0)) for g, eng in enumerate(self.ranks)], axis=2)
        out: F64 = times[:, :, table.active_mask].max(axis=2).sum(axis=1)
        return out

    def load_ms(self, table: RoutingTable, counts: npt.NDArray[np.integer], rel: float = 0.1) -> float:
        """Milliseconds of a step that scale with its busiest rank's load under `table`, mean over `counts`' steps:
        the change of the MoE part when every expert's load changes by +-`rel`, over 2 x `rel` (a central
        difference: the load's elasticity times the step). This is what a plan that lowers the busiest rank's
        load by a fraction g saves, g x load_ms, the figure controlplane.worth decides with; the weight reads of
        the experts a rank serves do not scale with the load and are left out (the MoE part minus the step with no
        routed tokens, `moe_ms(counts) - moe_ms(0)`, counts them: results.json sets it beside as
        `moe_ms_engine`). The reference figure results.json sets beside the agents' own fit of it
        (bench.measured.step_time_entry; controlplane.steptime), which they make from the step times this
        engine's plugins report."""
        c = np.asarray(counts, dtype=np.int64)
        up = self.moe_ms(table, np.rint(c * (1.0 + rel)).astype(np.int64))
        down = self.moe_ms(table, np.rint(c * (1.0 - rel)).astype(np.int64))
        return float((up.mean() - down.mean()) / (2.0 * rel))

    def moves(self, old: RoutingTable, new: RoutingTable, dead: npt.NDArray[np.bool_] | None = None) -> Moves:
        """Copies into every slot whose expert changes, each from the nearest live holder in `old`
        (same rank, then same node, then another node, lowest rank id), else from host. dead [G]: ranks
        whose weights are gone."""
        topo = self.topo
        G, S = topo.ranks, topo.slots_per_rank
        L, E = new.layers, new.experts
        changed = (new.phy2log != old.phy2log) & (new.phy2log >= 0)
        li, pi = np.nonzero(changed)
        bytes_to = np.zeros((G, 4), dtype=np.float64)
        if li.size == 0:
            return Moves(0, 0.0, bytes_to)
        e = new.phy2log[li, pi]
        dst = pi // S
        has = np.zeros((L, E, G), dtype=bool)
        lo, po = np.nonzero(old.phy2log >= 0)
        has[lo, old.phy2log[lo, po], po // S] = True
        if dead is not None:
            has[:, :, dead] = False
        holders = has[li, e]  # [C, G]
        node = np.arange(G) // topo.ranks_per_node
        same_rank = holders[np.arange(li.size), dst]
        same_node = (holders & (node[None, :] == node[dst][:, None])).any(axis=1)
        anywhere = holders.any(axis=1)
        tier = np.where(same_rank, Tier.SAME_RANK, np.where(same_node, Tier.SAME_NODE,
                        np.where(anywhere, Tier.OTHER_NODE, Tier.HOST)))
        np.add.at(bytes_to, (dst, tier), self.shape.expert_bytes)
        return Moves(int(li.size), float(li.size * self.shape.expert_bytes), bytes_to)

    def copy_ms(self, moves: Moves, share: float = 1.0) -> float:
        """Time for `moves` when each rank's links give them `share` of their bandwidth: per rank the
        slowest tier (tiers run in parallel), then the slowest rank."""
        bw = np.asarray(self.topo.tier_bandwidth, dtype=np.float64) * share
        return float((moves.bytes_to / bw[None, :]).max(initial=0.0) * 1e3)

    def link_scale_during(self, moves: Moves, share: float) -> F64:
        """[G, 2] (NVLink, IB) bandwidth left to serving on each rank while `moves` copy at `share`."""
        out = np.ones((self.topo.ranks, 2), dtype=np.float64)
        out[moves.bytes_to[:, Tier.SAME_NODE] > 0, 0] = 1.0 - share
        out[moves.bytes_to[:, Tier.OTHER_NODE] > 0, 1] = 1.0 - share
        return out
