"""Load shifts of the simulated cluster: the trace the engines play changes while they serve.

- `drift`: each layer's experts trade popularity (a seeded permutation of the expert axis): a workload change
  the agents should answer with a rebalance.
- `against_next_commit`: armed until the next rebalance commits; at that instant the load turns against it:
  each layer's popularity is permuted (out of a few hundred drawn) to the one the committed table serves worst
  relative to its parent. The change then realises worse than its parent would have, which the controller
  must roll back within N windows (I6), so that every run of these exercises a rollback end to end.
"""

from __future__ import annotations

import random

import numpy as np

from chaos.simcluster import CommitRecord, SimCluster
from controlplane.load import rank_load

CANDIDATES = 256  # permutations drawn per layer for `against_next_commit`


def _permute(c: SimCluster, perms: np.ndarray) -> None:
    """Expert e of layer l now gets the load expert perms[l, e] had: trace[..., l, e] <- trace[..., l, perms[l, e]]."""
    rows = np.arange(perms.shape[0])[:, None]
    c.trace = c.trace[:, rows, perms]


def drift(c: SimCluster, rng: random.Random) -> str:
    L, E = c.trace.shape[1:]
    nrng = np.random.default_rng(rng.getrandbits(32))
    _permute(c, np.stack([nrng.permutation(E) for _ in range(L)]))
    c._fault("shift drift")
    return "shift drift"


def against_next_commit(c: SimCluster, rng: random.Random) -> str:
    nrng = np.random.default_rng(rng.getrandbits(32))
    armed = [True]

    def turn(r: CommitRecord) -> None:
        parent = c.history.commits[r.parent].table if r.parent in c.history.commits else c.genesis
        if not armed[0] or r.kind != "rebalance" or parent.version != r.parent:
            return
        armed[0] = False
        L, E = c.trace.shape[1:]
        mean = c.trace.mean(axis=0)  # [L, E]
        perms = np.stack([np.stack([nrng.permutation(E) for _ in range(L)]) for _ in range(CANDIDATES)])  # [K, L, E]
        cand = np.take_along_axis(np.broadcast_to(mean, perms.shape), perms, axis=2)  # [K, L, E]
        worse = rank_load(r.table, cand).max(axis=2) - rank_load(parent, cand).max(axis=2)  # [K, L]
        best = worse.argmax(axis=0)  # per layer
        _permute(c, perms[best, np.arange(L)])
        c._fault(f"shift against v{r.version}")

    c.on_new_commit.append(turn)
    return "shift against-next-commit"
