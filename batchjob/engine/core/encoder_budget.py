"""The image encoder's share of a step (vLLM's encoder compute budget and EncoderCacheManager, on the scheduler's
side): a step encodes images whose placeholders hold at most `tokens_per_step` rows of encoder output, so one step
never carries a pile of fresh pictures while the decodes beside it wait. A row whose chunk would start an image the
step has no encoder room for computes up to that image (or waits a step); an image larger than the whole budget may
go first in a step of its own, so every row makes progress.

An image whose output the worker's encoder cache (engine/worker/encoder.py) holds costs nothing: this module keeps
the digests the cache holds by the same rule (least recently used dropped once they exceed its capacity in
placeholder rows), updated in the order the worker reads and fills it. The mirror is advisory: if it ever
disagrees with the worker's cache, an image is encoded or read all the same; only the step's encoder load is off."""
from __future__ import annotations

from collections import OrderedDict

from batchjob.engine.params import ImageSlot


class EncoderBudget:
    def __init__(self, tokens_per_step: int, cache_tokens: int) -> None:
        self.tokens_per_step = tokens_per_step
        self.cache_tokens = cache_tokens
        self._cached: OrderedDict[str, int] = OrderedDict()  # digest -> placeholder rows, least recent first
        self._rows = 0

    def cached(self, digest: str) -> bool:
        return digest in self._cached

    def starts(self, images: list[ImageSlot], start: int, n: int) -> list[ImageSlot]:
        """The images a chunk of `n` tokens from `start` begins (their first placeholder in it): where the worker
        encodes or reads an image (a run split over chunks keeps its output on the row)."""
        return [img for img in images if start <= img.offset < start + n]

    def cut(self, images: list[ImageSlot], start: int, n: int, left: int, fresh_step: bool) -> tuple[int, int]:
        """(tokens of the chunk within the step's encoder room, encoder tokens they cost): the chunk ends before the
        first image it would start that is not cached and does not fit `left`. `fresh_step`: nothing was encoded in
        this step yet, so an image larger than the budget may go."""
        cost = 0
        seen: set[str] = set()
        for img in sorted(self.starts(images, start, n), key=lambda i: i.offset):
            if img.digest in self._cached or img.digest in seen:
                continue
            if cost + img.length > left and not (fresh_step and cost == 0):
                return img.offset - start, cost
            cost += img.length
            seen.add(img.digest)
        return n, cost

    def scheduled(self, images: list[ImageSlot], start: int, n: int) -> None:
        """The chunk goes into the step: the worker reads each image it begins from its cache, or encodes and
        keeps it; the mirror does the same, in the same order."""
        for img in self.starts(images, start, n):
            if img.digest in self._cached:
                self._cached.move_to_end(img.digest)
            elif img.length <= self.cache_tokens:
                self._cached[img.digest] = img.length
                self._rows += img.length
                while self._rows > self.cache_tokens:
                    _, dropped = self._cached.popitem(last=False)
                    self._rows -= dropped
