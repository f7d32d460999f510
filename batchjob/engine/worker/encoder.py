"""Image rows' input embeddings for a step (issue 34): the step's token embeddings, with the positions of each
image's placeholders that the step computes replaced by the rows of that image's encoder output. An image is
encoded once, at the first step that reads any of its placeholders, alone (its features do not depend on the
other images of the step), and its output is kept on the worker's row until the row's prompt is computed: chunked
prefill may split a placeholder run across steps. A row recomputed after preemption encodes again."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine.worker.input_batch import CachedRow


@dataclass(slots=True)
class EncoderStats:
    """The image encoder's work so far: placeholder runs encoded (an image, or one tile of one) and its seconds."""
    images: int = 0
    seconds: float = 0.0


def step_embeds(model, rows: list[CachedRow], last: list[int], input_ids: torch.Tensor,
                stats: EncoderStats) -> torch.Tensor | None:
    """inputs_embeds [T, hidden] for a step that computes image placeholders, else None (token ids suffice).
    `last[i]`: the flat index of row i's last token in the step. The encoder's work is added to `stats`."""
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
            img = row.images[k]
            t0 = time.perf_counter()
            pixels = torch.from_numpy(np.ascontiguousarray(img.pixel_values, dtype=np.float32))[None].to(model.device)
            feats = model.image_encoder(pixels)[0]
            stats.images += 1
            stats.seconds += time.perf_counter() - t0
            if feats.shape[0] != img.length:
                raise ValueError(f"image {k}: the encoder gives {feats.shape[0]} rows for {img.length} placeholders")
            row.encoded[k] = feats
        embeds[at:at + b - a] = feats[a:b].to(embeds.dtype)
    for row in done:
        row.encoded = None  # the prompt is computed: its images' outputs are not read again
    return embeds
