"""controlplane.retarget.exchange runs every layer's local search side by side, vectorised over layers: it must
take the same steps, in the same order, as the search written one layer at a time (kept here as the reference)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from controlplane import retarget
from controlplane.ops import Migrate, Operation, Swap
from controlplane.table import RoutingTable, initial_table
from controlplane.topology import Topology

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


def one_layer_at_a_time(head: RoutingTable, start: tuple[I64, dict[int, list[Operation]]], weight: F64, lam: F64,
             max_steps: int = 4000) -> tuple[I64, dict[int, list[Operation]]]:
    """controlplane.retarget.exchange as it was written first: one layer after another."""
    topo = head.topology
    G, S, L, E = topo.ranks, topo.slots_per_rank, head.layers, head.experts
    act = head.active_mask
    others = act[None, :, None]
    out = start[0].reshape(L, G, S).copy()
    ops = {lay: list(o) for lay, o in start[1].items()}
    head_holds = head.holders  # [L, E, G]
    for lay in range(L):
        row = out[lay]
        ok_slot = row >= 0
        cnt = np.bincount(row[ok_slot], minlength=E)
        pw = np.where(ok_slot, weight[lay][np.maximum(row, 0)] / np.maximum(cnt[np.maximum(row, 0)], 1), 0.0)
        pw[~act] = 0.0
        hold = np.zeros((E + 1, G), dtype=bool)  # row E: the empty slot, held nowhere
        gi, si = np.nonzero(ok_slot)
        hold[row[gi, si], gi] = True
        hh = np.vstack([head_holds[lay], np.zeros((1, G), dtype=bool)])
        moved = int((hold[:E] & ~hh[:E]).sum())
        load = np.where(act, pw.sum(axis=1), -np.inf)
        best_v, best_k, top0 = 0.0, 0, float(load.max())
        steps: list[tuple[int, int, int, int, int, int]] = []  # (h, slot on h, g, slot on g, expert h->g, g->h or -1)
        for _ in range(max_steps):
            h = int(np.argmax(load))
            a = row[h]  # [S]
            d = pw[h][:, None, None] - pw[None, :, :]  # [S, G, S]: load leaving h
            newmax = np.maximum(load[h] - d, load[None, :, None] + d)
            b = np.where(row >= 0, row, E)
            ok = (d > 0) & others & (a >= 0)[:, None, None] & ~hold[np.where(a >= 0, a, E)][:, :, None]
            ok &= ~hold[b, h][None, :, :]
            ok[:, h, :] = False
            score = np.where(ok, newmax, np.inf)
            k = int(np.argmin(score))
            if not score.flat[k] < load[h] - 1e-9:
                break
            ai, g, bi = (int(x) for x in np.unravel_index(k, score.shape))
            ea, eb = int(row[h, ai]), int(b[g, bi])
            moved += int(not hh[ea, g]) - int(not hh[ea, h]) + int(not hh[eb, h]) - int(not hh[eb, g]) \
                if eb < E else int(not hh[ea, g]) - int(not hh[ea, h])
            hold[ea, h], hold[ea, g] = False, True
            if eb < E:
                hold[eb, g], hold[eb, h] = False, True
            row[h, ai], row[g, bi] = row[g, bi], row[h, ai]
            pw[h, ai], pw[g, bi] = pw[g, bi], pw[h, ai]
            load[h], load[g] = pw[h].sum(), pw[g].sum()
            steps.append((h, ai, g, bi, ea, eb if eb < E else -1))
            v = (top0 - float(load.max())) - float(lam[lay]) * moved
            if v > best_v + 1e-9:
                best_v, best_k = v, len(steps)
        for h, ai, g, bi, _, _ in reversed(steps[best_k:]):  # undo the steps past the best prefix
            row[h, ai], row[g, bi] = row[g, bi], row[h, ai]
        if best_k:
            ops.setdefault(lay, []).extend(Migrate(lay, ea, h, g) if eb < 0 else Swap(lay, ea, h, eb, g)
                                           for h, _, g, _, ea, eb in steps[:best_k])
    res: I64 = out.reshape(L, G * S)
    return res, ops


def _case(seed: int, nodes: int, rpn: int, slots: int, layers: int, experts: int, recounted: bool,
          drain: int | None) -> tuple[RoutingTable, tuple[I64, dict[int, list[Operation]]], F64, F64]:
    rng = np.random.default_rng(seed)
    head = initial_table(Topology(nodes, rpn, slots), layers, experts)
    if drain is not None:
        from controlplane.ops import Drain, apply_ops

        head = apply_ops(head, [Drain(drain)])
    p = rng.dirichlet(np.full(experts, 0.3), size=layers)
    weight = (p * 10_000).astype(np.float64)
    start = retarget.recount(head, weight) if recounted else (head.phy2log.copy(), {})
    lam = rng.uniform(0.0, 50.0, size=layers)
    return head, start, weight, lam


@pytest.mark.parametrize("seed", range(20))
def test_the_layers_side_by_side_take_the_same_steps_as_one_layer_at_a_time(seed: int) -> None:
    shapes = [(2, 4, 3, 6, 16), (4, 8, 5, 5, 64), (2, 8, 4, 3, 48), (1, 4, 6, 4, 16), (2, 4, 9, 3, 24)]
    nodes, rpn, slots, layers, experts = shapes[seed % len(shapes)]
    head, start, weight, lam = _case(seed, nodes, rpn, slots, layers, experts, recounted=seed % 2 == 1,
                                     drain=1 if seed % 3 == 2 else None)
    if seed % 4 == 0:
        lam = np.zeros_like(lam)  # no byte price: each layer searches as long as it improves (swaps too)
    got_phy, got_ops = retarget.exchange(head, start, weight, lam)
    want_phy, want_ops = one_layer_at_a_time(head, start, weight, lam)
    assert np.array_equal(got_phy, want_phy)
    assert got_ops == want_ops
    assert any(got_ops.values()) or seed % 2 == 1  # the case moves something (else it proves nothing)


@pytest.mark.parametrize("max_steps", [1, 3])
def test_the_step_bound_holds_per_layer(max_steps: int) -> None:
    head, start, weight, lam = _case(3, 4, 8, 5, 5, 64, recounted=False, drain=None)
    lam = np.zeros_like(lam)
    got = retarget.exchange(head, start, weight, lam, max_steps=max_steps)
    want = one_layer_at_a_time(head, start, weight, lam, max_steps=max_steps)
    assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    assert all(len(o) <= max_steps for o in got[1].values()) and any(got[1].values())
