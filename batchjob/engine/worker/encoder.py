"""Image rows' input embeddings for a step (issue 34): the step's token embeddings, with the positions of each
image's placeholders that the step computes replaced by the rows of that image's encoder output. An image is
encoded at the first step that reads any of its placeholders, alone (its features do not depend on the other
images of the step), and its output is kept on the worker's row until the row's prompt is computed: chunked
prefill may split a placeholder run across steps.

Encoder outputs are also kept by image digest across rows (EncoderCache, vLLM's encoder cache): rows that ask
about the same picture (VQA datasets: several questions an image) encode it once, and so does a row recomputed
after preemption. An image is encoded alone, so its cached output is the one it would get again, bit for bit."""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.worker.input_batch import CachedRow


@dataclass(slots=True)
class EncoderStats:
    """The image encoder's work so far: placeholder runs encoded (an image, or one tile of one) and its seconds, and
    the runs whose output came from the encoder cache instead."""
    images: int = 0
    seconds: float = 0.0
    cached: int = 0


class EncoderCache:
    """Encoder outputs by image digest (a placeholder run's: an image, or one tile of one), the least recently used
    dropped first once they hold more than `capacity` rows (placeholder tokens) in all; 0 turns it off."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.rows = 0

    def get(self, digest: str) -> torch.Tensor | None:
        feats = self.entries.get(digest)
        if feats is not None:
            self.entries.move_to_end(digest)
        return feats

    def put(self, digest: str, feats: torch.Tensor) -> None:
        if feats.shape[0] > self.capacity or digest in self.entries:
            return
        self.entries[digest] = feats
        self.rows += feats.shape[0]
        while self.rows > self.capacity:
            _, dropped = self.entries.popitem(last=False)
            self.rows -= dropped.shape[0]


def step_embeds(model, rows: list[CachedRow], last: list[int], input_ids: torch.Tensor, stats: EncoderStats,
                cache: EncoderCache) -> torch.Tensor | None:
    """inputs_embeds [T, hidden] for a step that computes image placeholders, else None (token ids suffice).
    `last[i]`: the flat index of row i's last token in the step. The encoder's work is added to `stats`; its outputs
    are read from and kept in `cache`."""
    spans = []  # (row, image index, flat index of the first position, first and end rows of the encoder output)
    done = []
    for i, row in enumerate(rows):
        start, n = row.num_computed, row.num_new
        if not row.images or start >= row.num_prompt:
            continue
        first = last[i] - n + 1  # the flat index of position `start`
        for k, img in enumerate(row.images):
            lo, hi = max(start, img.offset), min(start + n, img.offset + img.length)
            if lo < hi:
                spans.append((row, k, first + lo - start, lo - img.offset, hi - img.offset))
        if start + n >= row.num_prompt:
            done.append(row)
    if not spans:
        return None
    embeds = model.embed_tokens(input_ids)
    for row, k, at, a, b in spans:
        if row.encoded is None:
            row.encoded = {}
        feats = row.encoded.get(k)
        if feats is None:
            feats = cache.get(row.images[k].digest)
            if feats is not None:
                stats.cached += 1
                row.encoded[k] = feats
        if feats is None:
            img = row.images[k]
            t0 = time.perf_counter()
            pixels = torch.from_numpy(np.ascontiguousarray(img.pixel_values, dtype=np.float32))[None].to(model.device)
            feats = model.image_encoder(pixels)[0]
            stats.images += 1
            stats.seconds += time.perf_counter() - t0
            if feats.shape[0] != img.length:
                raise ValueError(f"image {k}: the encoder gives {feats.shape[0]} rows for {img.length} placeholders")
            row.encoded[k] = feats
            cache.put(img.digest, feats)
        embeds[at:at + b - a] = feats[a:b].to(embeds.dtype)
    for row in done:
        row.encoded = None  # the prompt is computed: its images' outputs are not read again
    return embeds
