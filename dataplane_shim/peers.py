"""Naming the EP peer a failed collective lost, for the engine plugins (vLLM, SGLang).

gloo's and NCCL's errors say that a pair closed or an operation timed out, not which rank is gone. Every
rank's plugin beats a counter in the process group's key-value store (the TCPStore `init_process_group`
made); after a failed collective, the peers whose counters stopped are the unreachable ones, and the plugin
reports them to its agent at once (`PluginCore.peer_unreachable`, `report_evidence`). No torch import here:
the store is handed in (`default_store()` finds torch.distributed's).
"""

from __future__ import annotations

import threading
import time
from typing import Any


class PeerWatch:
    """Which EP peers are alive, told through the process group's key-value store (the TCPStore that
    `init_process_group` made), so that a failed collective can name the rank it lost: gloo's error says
    only that a pair closed or a receive timed out. A daemon thread bumps this rank's counter every
    `period_s` (it runs while the step is blocked in a collective); after a failure, peers whose counters
    did not move over `wait_s` are unreachable. Keys are per `prefix` (one per EP group). When the store
    itself cannot be reached its host is gone, but which EP rank that is depends on the engine's layout:
    then nothing is named (the agents' own probes find it)."""

    def __init__(self, store: Any, rank: int, world: int, period_s: float = 0.25, prefix: str = "elasticmoe") -> None:
        self.store, self.rank, self.world, self.period_s = store, rank, world, period_s
        self.key = f"{prefix}/alive/{{}}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"elasticmoe-alive-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.store.add(self.key.format(self.rank), 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: nothing to tell anyone
                return

    def _counters(self) -> list[int] | None:
        try:
            return [int(self.store.add(self.key.format(r), 0)) for r in range(self.world)]
        except Exception:  # noqa: BLE001 - any store failure means its host is unreachable
            return None

    def unreachable(self, wait_s: float | None = None) -> list[int]:
        """The peers that stopped beating (blocks about `wait_s`, 4 periods by default)."""
        first = self._counters()
        if first is not None:
            time.sleep(4 * self.period_s if wait_s is None else wait_s)
            second = self._counters()
            if second is not None:
                return [r for r in range(self.world) if r != self.rank and second[r] == first[r]]
        return []

    def close(self, timeout: float = 5.0) -> None:
        """Stop beating and wait up to `timeout` for the thread (a store call in flight is bounded by the
        store's own timeout); idempotent."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)


def default_store() -> Any:
    """The store of torch.distributed's default group (None if there is none)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no default group, or a backend without a store
        return None
