"""The simulator's clock: the kinds of event that can happen at a time, and the queue
that replays them in time order (ties in the order they were pushed, so a run is the
same every time).

Apart from the event loop (sim/engine.py) because every part of a run pushes events:
the dispatch round, the pack lifecycle and a snapshot's resume all schedule what
happens next.
"""

from __future__ import annotations

import heapq
import math

ARRIVAL, TICK, PACK_START, MEMBER_READY = 0, 1, 2, 3
NODE_FAIL, NODE_BACK, OBSERVE = 4, 5, 6  # only with `faults` (sim/faults.py)
RESUBMIT = 7  # a user resubmits a failed job (retry.user_resubmits)
SNAPSHOT = 8  # snapshot_at_s: the loop stops there to record one
PACK_RELEASE = 9  # slurm.pack_release_s after a pack's last member ended: its GPUs are free
MULTINODE_END = 10  # a whole-node multi-node job ends (sim/multinode.py)
EPS = 1e-9


class EventQueue:
    """A heap of (time s, push order, kind, payload)."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, object]] = []
        self._seq = 0

    def push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.heap, (t, self._seq, kind, payload))
        self._seq += 1

    def __len__(self) -> int:
        return len(self.heap)

    def next_s(self) -> float:
        """When the next event happens (inf: none left)."""
        return self.heap[0][0] if self.heap else math.inf

    def pop_due(self, now: float) -> tuple[int, object] | None:
        """(kind, payload) of the next event due at `now`, taken off the queue; None: none."""
        if self.heap and self.heap[0][0] <= now + EPS:
            _, _, kind, payload = heapq.heappop(self.heap)
            return kind, payload
        return None
