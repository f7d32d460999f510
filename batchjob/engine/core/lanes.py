"""Lanes: the waiting rows, one FIFO queue per lane, and which lane admits next (strict priority, aging,
weighted fair share in tokens). Pure bookkeeping over Sequence objects: no blocks, no tensors."""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from batchjob.engine.core.sequence import Sequence


@dataclass(slots=True)
class Lane:
    name: str = "default"
    priority: int = 0  # higher is admitted first
    weight: float = 1.0  # share of tokens among lanes of equal priority


class LaneQueues:
    def __init__(self, lanes: list[Lane], max_wait: float, aging: float, clock: Callable[[], float]):
        self.lanes = {lane.name: lane for lane in lanes}
        self.waiting: dict[str, deque[Sequence]] = {name: deque() for name in self.lanes}
        self.served = {name: 0.0 for name in self.lanes}  # tokens scheduled per lane
        self.max_wait = max_wait
        span = max(lane.priority for lane in lanes) - min(lane.priority for lane in lanes)
        self.aging = aging or (span + 1) / max_wait  # 0: a row reaches the top lane at max_wait
        self.clock = clock

    def __len__(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def add(self, seq: Sequence, running: list[Sequence]) -> None:
        """Queue a new row at the back of its lane (`running`: the rows running now)."""
        if seq.lane not in self.lanes:
            raise ValueError(f"unknown lane {seq.lane!r}; lanes: {', '.join(self.lanes)}")
        seq.priority = self.lanes[seq.lane].priority
        seq.enqueued_at = self.clock()
        q = self.waiting[seq.lane]
        if not q and not any(s.lane == seq.lane for s in running):
            self._catch_up(seq.lane)
        q.append(seq)

    def requeue(self, seq: Sequence) -> None:
        """A preempted row goes back to the front of its lane."""
        self.waiting[seq.lane].appendleft(seq)

    def pop(self, seq: Sequence) -> None:
        """Remove `seq`, the head of its lane (as `head()` returned it), to admit it."""
        self.waiting[seq.lane].popleft()

    def remove(self, seq: Sequence) -> None:
        """Take a waiting row out wherever it is (a preempted row that finished meanwhile)."""
        self.waiting[seq.lane].remove(seq)

    def charge(self, seq: Sequence, tokens: int) -> None:
        """Count tokens scheduled for (or, negative, refunded from) `seq` against its lane's share."""
        self.served[seq.lane] += tokens

    def head(self) -> Sequence | None:
        """The row admission tries next: the head of the lane that `lane_key` ranks first."""
        now = self.clock()
        best, best_key = None, None
        for name, q in self.waiting.items():
            if q:
                key = lane_key(self.lanes[name], now - q[0].enqueued_at, self.served[name], self.max_wait, self.aging)
                if best_key is None or key > best_key:
                    best, best_key = q[0], key
        return best

    def drop_unstarted(self) -> list[Sequence]:
        """Remove and return the rows that never started; preempted rows keep their place."""
        dropped = []
        for q in self.waiting.values():
            started = [s for s in q if s.first_scheduled_at is not None]
            dropped.extend(s for s in q if s.first_scheduled_at is None)
            q.clear()
            q.extend(started)
        return dropped

    def _catch_up(self, lane: str) -> None:
        """A lane that was idle joins at the others' virtual time instead of claiming its idle share."""
        active = [self.served[n] / self.lanes[n].weight for n, q in self.waiting.items() if q and n != lane]
        if active:
            self.served[lane] = max(self.served[lane], min(active) * self.lanes[lane].weight)


def lane_key(lane: Lane, waited: float, served: float, max_wait: float, aging: float) -> tuple:
    """Larger is admitted first: overdue rows (oldest first), then effective priority (priority plus
    aging, in whole levels), then the lane furthest below its weighted share of tokens."""
    overdue = waited >= max_wait
    effective = lane.priority + math.floor(aging * waited)
    return (overdue, waited if overdue else 0.0, effective, -served / lane.weight)


# which running row goes first, and which gives way (scheduler.py)

def victim_order(seq: Sequence) -> tuple:
    """Smallest is preempted first: lowest priority, then the youngest."""
    return (seq.priority, -seq.arrival)


def admit_order(seq: Sequence) -> tuple:
    return (-seq.priority, seq.arrival)
