from __future__ import annotations

import random

import pytest

from batchjob.io.ranges import RowRanges


def test_add_merges_overlapping_and_touching_ranges():
    r = RowRanges()
    r.add(10, 20)
    r.add(30, 40)
    r.add(20, 25)  # touches [10, 20)
    assert r.ranges() == [(10, 25), (30, 40)]
    r.add(24, 31)  # bridges the gap
    assert r.ranges() == [(10, 40)]
    r.add(0, 5)
    r.add(12, 14)  # inside: no change
    assert r.ranges() == [(0, 5), (10, 40)]
    assert r.count() == 35


def test_add_row_builds_one_range_from_consecutive_rows_in_any_order():
    r = RowRanges()
    for i in [3, 1, 0, 2, 5, 4]:
        r.add_row(i)
    assert r.ranges() == [(0, 6)]
    assert r.num_ranges() == 1


def test_contains_and_covers():
    r = RowRanges([(0, 3), (10, 12)])
    assert [i for i in range(14) if i in r] == [0, 1, 2, 10, 11]
    assert r.covers(10, 12) and not r.covers(9, 12) and not r.covers(2, 11)
    assert r.covers(5, 5)  # empty interval


def test_missing_and_first_missing():
    r = RowRanges([(0, 3), (5, 7), (9, 20)])
    assert r.first_missing() == 3
    assert r.missing(12).ranges() == [(3, 5), (7, 9)]
    assert r.missing(25).ranges() == [(3, 5), (7, 9), (20, 25)]
    assert RowRanges().missing(4).ranges() == [(0, 4)]
    assert RowRanges([(0, 10)]).first_missing(10) is None
    assert RowRanges([(1, 10)]).first_missing(10) == 0


def test_union_and_json_round_trip():
    a = RowRanges([(0, 5)])
    b = RowRanges([(5, 8), (20, 30)])
    u = a.union(b)
    assert u.ranges() == [(0, 8), (20, 30)]
    assert a.ranges() == [(0, 5)]  # union returns a new set
    assert RowRanges.from_json(u.to_json()) == u
    assert u.to_json() == [[0, 8], [20, 30]]


def test_rejects_bad_ranges():
    with pytest.raises(ValueError):
        RowRanges().add(5, 3)
    with pytest.raises(ValueError):
        RowRanges().add(-1, 3)


def test_matches_a_plain_set_under_random_adds():
    rng = random.Random(0)
    r, plain = RowRanges(), set()
    for _ in range(2000):
        s = rng.randrange(500)
        e = s + rng.randrange(4)
        r.add(s, e)
        plain.update(range(s, e))
        ranges = r.ranges()
        assert all(a < b for a, b in ranges)
        assert all(b1 < a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:]))  # disjoint, not touching
    assert set(r) == plain
    assert r.count() == len(plain)
    assert set(r.missing(510)) == set(range(510)) - plain


def test_memory_grows_with_ranges_not_rows():
    r = RowRanges()
    for i in range(100_000):
        r.add_row(i)
    assert r.num_ranges() == 1 and r.count() == 100_000
