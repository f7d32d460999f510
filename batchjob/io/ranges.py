"""RowRanges: a sorted set of row indices stored as disjoint half-open [start, end) ranges.

Memory grows with the number of gaps, not rows: a finished million-row job is one range.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator


class RowRanges:
    __slots__ = ("_starts", "_ends")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        # Parallel sorted lists; _starts[i] < _ends[i] <= _starts[i+1] - 1 (touching ranges merge).
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in ranges:
            self.add(start, end)

    def add(self, start: int, end: int) -> None:
        if start < 0 or end < start:
            raise ValueError(f"bad range [{start}, {end})")
        if start == end:
            return
        # Every range that overlaps or touches [start, end) is absorbed.
        lo = bisect_left(self._ends, start)  # first range whose end >= start
        hi = bisect_right(self._starts, end)  # ranges with start <= end
        if lo < hi:
            start = min(start, self._starts[lo])
            end = max(end, self._ends[hi - 1])
        self._starts[lo:hi] = [start]
        self._ends[lo:hi] = [end]

    def add_row(self, i: int) -> None:
        self.add(i, i + 1)

    def __contains__(self, i: object) -> bool:
        if not isinstance(i, int):
            return False
        k = bisect_right(self._starts, i) - 1
        return k >= 0 and i < self._ends[k]

    def span_of(self, i: int) -> tuple[int, int] | None:
        """The range holding row i, or None; lets readers jump over a whole skipped stretch."""
        k = bisect_right(self._starts, i) - 1
        if k >= 0 and i < self._ends[k]:
            return self._starts[k], self._ends[k]
        return None

    def covers(self, start: int, end: int) -> bool:
        """True when every row of [start, end) is in the set (empty interval: True)."""
        if start >= end:
            return True
        span = self.span_of(start)
        return span is not None and end <= span[1]

    def count(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))

    def __len__(self) -> int:
        return self.count()

    def __bool__(self) -> bool:
        return bool(self._starts)

    def num_ranges(self) -> int:
        return len(self._starts)

    def describe(self, most: int = 5) -> str:
        """'3, 10-19 and 4 more ranges' (inclusive, as people count rows)."""
        spans = self.ranges()
        shown = ", ".join(f"{s}-{e - 1}" if e - s > 1 else str(s) for s, e in spans[:most])
        return shown + (f" and {len(spans) - most} more ranges" if len(spans) > most else "")

    def ranges(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    def __iter__(self) -> Iterator[int]:
        for s, e in zip(self._starts, self._ends):
            yield from range(s, e)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RowRanges):
            return NotImplemented
        return self._starts == other._starts and self._ends == other._ends

    def __repr__(self) -> str:
        shown = ", ".join(f"[{s}, {e})" for s, e in self.ranges()[:8])
        more = ", ..." if len(self._starts) > 8 else ""
        return f"RowRanges({shown}{more})"

    def copy(self) -> RowRanges:
        out = RowRanges()
        out._starts = list(self._starts)
        out._ends = list(self._ends)
        return out

    def union(self, other: RowRanges) -> RowRanges:
        out = self.copy()
        for s, e in other.ranges():
            out.add(s, e)
        return out

    __or__ = union

    def first_missing(self, total: int | None = None) -> int | None:
        """Smallest row index not in the set, or None when [0, total) is fully covered."""
        first = self._ends[0] if self._starts and self._starts[0] == 0 else 0
        if total is not None and first >= total:
            return None
        return first

    def missing(self, total: int) -> RowRanges:
        """The rows of [0, total) not in the set."""
        out = RowRanges()
        cursor = 0
        for s, e in zip(self._starts, self._ends):
            if s >= total:
                break
            if s > cursor:
                out._starts.append(cursor)
                out._ends.append(s)
            cursor = max(cursor, e)
        if cursor < total:
            out._starts.append(cursor)
            out._ends.append(total)
        return out

    @classmethod
    def merged(cls, ranges: Iterable[Iterable[int]]) -> RowRanges:
        """The union of many [start, end) ranges in one sort and one pass (a resume's committed rows)."""
        out = cls()
        starts, ends = out._starts, out._ends
        for s, e in sorted(ranges):  # [start, end] pairs as lists or tuples
            if s < 0 or e < s:
                raise ValueError(f"bad range [{s}, {e})")
            if s == e:
                continue
            if ends and s <= ends[-1]:
                if e > ends[-1]:
                    ends[-1] = e
            else:
                starts.append(s)
                ends.append(e)
        return out

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in zip(self._starts, self._ends)]

    @classmethod
    def from_json(cls, data: Iterable[Iterable[int]]) -> RowRanges:
        out = cls()
        for pair in data:
            s, e = pair
            out.add(int(s), int(e))
        return out
