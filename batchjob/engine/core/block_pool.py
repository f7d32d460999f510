"""BlockPool: the KV cache's fixed-size blocks as ids with reference counts, plus the prefix cache.

A full block is keyed by a SHA-256 digest chained over all token ids up to its end, so equal keys mean
equal prefixes (a collision-resistant digest: Python's `hash()` collides on crafted inputs, and a
collision would hand one row another prefix's KV). Blocks whose last user left keep their contents and
key (evictable, least recently used first) until the space is needed. Blocks without contents worth
keeping are reused last-freed first, so a job touches only the KV pages its rows need at once. No tensors here."""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque

ROOT = b""  # the parent of a row's first block


def block_hashes(token_ids: list[int], block_size: int, start: int = 0, parent: bytes | None = None,
                 images=()) -> list[bytes]:
    """Chained digests of the full blocks of `token_ids` from block index `start` on: each is
    SHA-256(parent digest + the block's token ids as int64 + the digest of each image whose placeholders the block
    holds). `images`: the row's ImageSlots (engine/params.py): the same text with another image is another
    prefix, the same image with the same text the same one."""
    out = []
    h = parent if parent is not None else ROOT
    for b in range(start, len(token_ids) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        key = h + array("q", token_ids[lo:hi]).tobytes()
        for img in images:
            if img.offset < hi and img.offset + img.length > lo:
                key += img.digest.encode()
        h = hashlib.sha256(key).digest()
        out.append(h)
    return out


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free: deque[int] = deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, contents kept; LRU first

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"KV pool exhausted: need {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.by_hash[self.hash_of[b]]
                self.hash_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def shrink(self, table: list[int], num_tokens: int) -> list[int]:
        """Release the blocks of `table` past the ones `num_tokens` tokens need (rejected proposals' KV); returns
        the table that remains, a new list if it shrank (a row's block table list otherwise only grows)."""
        keep = self.blocks_for(num_tokens)
        if len(table) > keep:
            self.release(table[keep:])
            return table[:keep]
        return table

    def release(self, blocks: list[int]) -> None:
        # freed in reverse so a row's tail blocks are evicted before its shared head blocks
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.hash_of[b] is not None:
                    self.evictable[b] = None
                else:  # reused first: its pages are warm in cache and memory stays the working set
                    self.free.appendleft(b)

    # prefix cache

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of `hashes` (not yet referenced)."""
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1

    def publish(self, seq) -> None:
        """Register `seq`'s full computed blocks not yet in the prefix cache (chained keys: engine/core/sequence)."""
        bs = self.block_size
        full = seq.num_computed // bs
        if self.enable_caching and full > len(seq.block_hashes):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.prefix_root
            new = block_hashes(seq.token_ids[:full * bs], bs, len(seq.block_hashes), parent, seq.images)
            for i, h in enumerate(new, start=len(seq.block_hashes)):
                self.register(seq.block_table[i], h)
            seq.block_hashes.extend(new)

    def register(self, block: int, h: bytes) -> None:
        if self.enable_caching and self.hash_of[block] is None and h not in self.by_hash:
            self.hash_of[block] = h
            self.by_hash[h] = block
