"""The prefix cache's block key: different prefixes never share KV, even where Python's hash() collides."""
from __future__ import annotations

from batchjob.engine.core.block_pool import BlockPool, block_hashes
from batchjob.engine.core.scheduler import Scheduler, SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence

# CPython's hash(-1) is -2 (-1 is its error code), so these blocks' tuples hash alike and the old key,
# chained hash((parent, tuple(block))) from 0, was the same for both prefixes
FIRST, COLLIDING = [-1, 5, 6, 7], [-2, 5, 6, 7]


def test_a_crafted_hash_collision_is_a_different_key():
    assert FIRST != COLLIDING and hash((0, tuple(FIRST))) == hash((0, tuple(COLLIDING)))
    assert block_hashes(FIRST, 4) != block_hashes(COLLIDING, 4)
    # and the chain: equal second blocks after colliding first blocks still differ
    assert block_hashes(FIRST + [1] * 4, 4)[1] != block_hashes(COLLIDING + [1] * 4, 4)[1]


def test_prefixes_with_colliding_python_hashes_share_no_kv():
    pool = BlockPool(16, 4, enable_caching=True)
    s = Scheduler(SchedulerConfig(), pool)
    first = Sequence(0, FIRST + [1, 2], SamplingParams(max_tokens=1))
    s.add(first)
    step = s.schedule()
    s.advance(step)
    s.publish(step)  # its first block is full and published to the prefix cache
    cached = list(first.block_table)
    s.finish(first, "length")
    second = Sequence(1, COLLIDING + [1, 2], SamplingParams(max_tokens=1))
    s.add(second)
    step = s.schedule()
    assert step.prefix_hit_tokens == 0 and second.num_computed == 0
    assert not set(second.block_table) & set(cached[:1])  # its own block, not the other prefix's KV
    # the same prefix again does hit: the cache still works
    s.advance(step)
    s.publish(step)
    s.finish(second, "length")
    again = Sequence(2, FIRST + [3, 4], SamplingParams(max_tokens=1))
    s.add(again)
    step = s.schedule()
    assert step.prefix_hit_tokens == 4 and again.block_table[0] == cached[0]


def test_block_keys_depend_on_every_token_and_its_place():
    ids = list(range(32))
    keys = block_hashes(ids, 8)
    assert len(keys) == 4 and len(set(keys)) == 4 and all(len(k) == 32 for k in keys)
    assert block_hashes(ids, 8, start=2, parent=keys[1]) == keys[2:]  # incremental = from scratch
    for i in (0, 9, 31):
        other = ids[:i] + [ids[i] + 1000] + ids[i + 1:]
        changed = block_hashes(other, 8)
        assert changed[:i // 8] == keys[:i // 8] and all(a != b for a, b in zip(changed[i // 8:], keys[i // 8:]))
