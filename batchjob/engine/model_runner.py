"""ModelRunner: turns a scheduled Step into flat tensors (input ids, positions, and the paged-attention
metadata: block tables, context lengths, query offsets, slot mapping), runs one forward, and samples the
rows whose tokens are all computed. Owns the KV tensors, laid out as the model's kernels want them, and
their host copy for swapped-out rows."""
from __future__ import annotations

import math
import time

import numpy as np

import torch

from batchjob.engine import sampler
from batchjob.engine.scheduler import Step
from batchjob.engine.sequence import PLACEHOLDER
from batchjob.engine.staging import StagingBuffers
from batchjob.kernels import AttentionMetadata
from batchjob.kernels.kv_quant import bytes_per_token_head, quantized_kv_caches
from batchjob.kernels.profiling import scope
from batchjob.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        c = model.config
        model.fit_kernels(block_size)
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        kv = model.kv_cache_dtype
        if kv == "auto":
            k_shape, v_shape = model.kernels.kv_cache_shapes(num_blocks, block_size, c.num_kv_heads, c.head_dim)
            self.kv_caches = [(_zeros(k_shape, model.dtype, model.device), _zeros(v_shape, model.dtype, model.device))
                              for _ in range(c.num_layers)]
        else:  # quantized (kernels/kv_quant.py): codes and scales, each a paged tensor, in the kernels' layout
            bits = {"int8": 8, "int4": 4}[kv]
            alloc = lambda shape, dtype: _zeros(shape, dtype, model.device)  # noqa: E731
            make = getattr(model.kernels, "quantized_kv_caches", quantized_kv_caches)  # native lays its own out
            self.kv_caches = [make(bits, num_blocks, block_size, c.num_kv_heads, c.head_dim, alloc)
                              for _ in range(c.num_layers)]
        # every paged tensor of a layer (K and V, or their codes and scales), with a host copy for swaps
        self.paged = [[t for cache in layer for t in _tensors(cache)] for layer in self.kv_caches]
        pin = model.device.type == "cuda"
        # empty, not zeros: every host block is written by a swap-out before it is read, and untouched
        # pages cost no memory or start-up time
        self.host_cache = [[torch.empty((num_host_blocks, math.prod(t.shape[1:])), dtype=t.dtype, pin_memory=pin)
                            for t in layer] for layer in self.paged] if num_host_blocks else None
        self.staging = StagingBuffers(model.device)
        self.decode_graphs = None  # engine/cuda_graphs.DecodeGraphs when decode steps replay CUDA graphs
        self.model_s = 0.0  # seconds inside the model (forward + logits), summed: the rest of a step is ours

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Copy preempted rows' blocks to the host pool, then swapped-in rows' blocks back. Returns bytes moved."""
        moved = 0
        for pairs, to_host in ((swap_out, True), (swap_in, False)):
            if not pairs:
                continue
            src = torch.tensor([a for a, _ in pairs], dtype=torch.long)
            dst = torch.tensor([b for _, b in pairs], dtype=torch.long)
            for layer, tensors in enumerate(self.paged):
                for j, cache in enumerate(tensors):
                    host = self.host_cache[layer][j]
                    blocks = cache.view(cache.shape[0], -1)
                    if to_host:
                        host[dst] = blocks[src.to(cache.device)].to("cpu")
                    else:
                        blocks[dst.to(cache.device)] = host[src].to(cache.device, non_blocking=True)
            moved += len(pairs) * self.kv_bytes_per_block(self.model, self.block_size)
        return moved

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        """K and V bytes of one block over all layers (codes and scales for a quantized cache)."""
        c = model.config
        per = bytes_per_token_head(model.kv_cache_dtype, c.head_dim, model.dtype)
        return 2 * c.num_layers * block_size * c.num_kv_heads * per

    def prepare(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Returns input_ids, positions, the attention metadata and the batch index of each row's last token.
        Rows are laid out decodes first (one token each), then prompt chunks, as the kernels expect."""
        order = sorted(range(len(step.seqs)), key=lambda i: step.num_new[i] != 1)
        rows = []
        for i in order:
            seq, n = step.seqs[i], step.num_new[i]
            start = seq.num_computed
            chunk = seq.token_ids[start:start + n]
            if len(chunk) < n:  # speculative: the row's last token, then its proposals
                chunk = chunk + seq.draft[:n - len(chunk)]
            rows.append((chunk, start, seq.block_table))
        input_ids, positions, meta, ends = flatten(rows, self.block_size, self.model.device.type != "cpu")
        last = [0] * len(step.seqs)
        for i, end in zip(order, ends):
            last[i] = end
        return input_ids, positions, meta, last

    def to_device(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """A step's inputs and metadata (in place) through the staging buffers onto the model's device."""
        if self.model.device.type == "cpu":
            return input_ids, positions
        stage = self.staging.to_device
        for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
            setattr(meta, name, stage(name, getattr(meta, name)))
        return stage("input_ids", input_ids), stage("positions", positions)

    def run(self, step: Step, in_flight: StepTokens | None = None) -> StepTokens:
        """One forward over the step, launched; returns its sampled tokens (None for mid-prompt chunks) as a
        handle whose `tolist()` waits for them. On a GPU the host is free until then; on the CPU the forward
        has run by the time this returns. `in_flight`: the step launched before this one, whose tokens are
        not back yet (async scheduling): a row whose last token is its placeholder reads the id that step
        sampled, on the device."""
        device = self.model.device
        self.staging.next_step()
        with scope("prepare"):
            input_ids, positions, meta, last = self.prepare(step)
        input_ids, positions = self.to_device(input_ids, positions, meta)
        fill = _placeholder_fill(step, last, in_flight, self.staging) if in_flight is not None else None
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(step.num_new):  # every row decodes: all of them sample
            t0 = time.perf_counter()
            logits = graphs.run(input_ids, positions, meta, fill)
            self.model_s += time.perf_counter() - t0
            rows = list(range(len(step.seqs)))
            with scope("sampler"):
                sampled = sampler.sample(logits, step.seqs, argmax=getattr(self.model.kernels, "argmax", None))
            return StepTokens(len(rows), rows, sampled, seqs=step.seqs)
        if fill is not None:
            input_ids[fill[0]] = fill[1]
        t0 = time.perf_counter()
        hidden = self.model.forward(input_ids, positions, meta, self.kv_caches)
        # rows whose tokens are all computed sample one token; a speculating row samples at its last token
        # and at each of its k proposals (it computes k tokens past its own)
        rows, spans, at, seqs = [], [], [], []
        for i, (s, n) in enumerate(zip(step.seqs, step.num_new)):
            k = s.num_computed + n - s.num_tokens
            if k >= 0:
                rows.append(i)
                spans.append(k + 1)
                at.extend(range(last[i] - k, last[i] + 1))
                seqs.extend([s] * (k + 1))
        # the logits stay on the model's device: sampling runs there and only token ids come back
        logits = self.model.raw_logits(hidden[self.staging.to_device("logit_rows", torch.tensor(at))]) if rows else None
        self.model_s += time.perf_counter() - t0
        if not rows:
            return StepTokens(len(step.seqs), rows, None, seqs=step.seqs)
        offsets = [j for span in spans for j in range(span)] if len(seqs) > len(rows) else None
        with scope("sampler"):
            sampled = sampler.sample(logits, seqs, argmax=getattr(self.model.kernels, "argmax", None), offsets=offsets)
        return StepTokens(len(step.seqs), rows, sampled, spans if offsets else None, seqs=step.seqs)


def flatten(rows: list[tuple[list[int], int, list[int]]], bs: int, host_copies: bool):
    """(tokens, first position, block table) per row, rows of one token first -> input_ids, positions, the
    attention metadata and the batch index of each row's last token."""
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    ends: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    for chunk, start, table in rows:
        ids.extend(chunk)
        rng = range(start, start + len(chunk))
        pos.extend(rng)
        slots.extend(table[p // bs] * bs + p % bs for p in rng)
        ends.append(len(ids) - 1)
        qsl.append(len(ids))
        seq_lens.append(start + len(chunk))
        tables.append(table[:-(-(start + len(chunk)) // bs)])
    width = max(map(len, tables), default=0)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)
    meta = AttentionMetadata(
        block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=sum(1 for chunk, _, _ in rows if len(chunk) == 1),
        # on a GPU, kernels plan from these host lists instead of reading the device tensors back (a sync)
        host={"query_start_loc": qsl, "seq_lens": seq_lens, "block_tables": block_tables} if host_copies else None,
    )
    return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, ends


def _placeholder_fill(step: Step, last: list[int], in_flight: StepTokens, staging: StagingBuffers) -> tuple | None:
    """(batch positions, ids) for the rows whose input is a placeholder: the ids `in_flight` sampled for
    them, still on the device (None when no row waits on it)."""
    at: list[int] = []
    src: list[int] = []
    index = None
    for i, (seq, n) in enumerate(zip(step.seqs, step.num_new)):
        if seq.token_ids[seq.num_computed + n - 1] == PLACEHOLDER:
            if index is None:
                index = {id(s): j for j, s in enumerate(in_flight.sampled_seqs())}
            at.append(last[i])
            src.append(index[id(seq)])
    if not at:
        return None
    ids = in_flight.sampled.ids
    return staging.to_device("fill_at", torch.tensor(at)), ids[staging.to_device("fill_src", torch.tensor(src))]


class StepTokens:
    """A launched step's sampled tokens per row: `tolist()` waits for them. None for mid-prompt chunks, an
    int for a row that sampled one token, a list for a speculating row (one token per verified position)."""

    __slots__ = ("num_rows", "rows", "sampled", "spans", "seqs")

    def __init__(self, num_rows: int, rows: list[int], sampled: sampler.SampledTokens | None,
                 spans: list[int] | None = None, seqs: list | None = None):
        self.num_rows, self.rows, self.sampled, self.spans = num_rows, rows, sampled, spans
        self.seqs = seqs  # the step's rows (Sequence objects), in step order

    def sampled_seqs(self) -> list:
        """The row of each sampled id, in the order of `sampled.ids` (rows of one token only)."""
        assert self.spans is None, "a speculating step is never in flight"
        return [self.seqs[i] for i in self.rows]

    def __len__(self) -> int:
        return self.num_rows

    def single_rows(self) -> list[int]:
        """The rows that sample one token (not speculating)."""
        if self.spans is None:
            return self.rows
        return [i for i, span in zip(self.rows, self.spans) if span == 1]

    def tolist(self) -> list[int | list[int] | None]:
        out: list = [None] * self.num_rows
        if self.sampled is None:
            return out
        tokens = self.sampled.tolist()
        if self.spans is None:
            for i, t in zip(self.rows, tokens):
                out[i] = t
            return out
        j = 0
        for i, span in zip(self.rows, self.spans):
            out[i] = tokens[j] if span == 1 else tokens[j:j + span]
            j += span
        return out


def _tensors(cache) -> tuple[torch.Tensor, ...]:
    return cache.tensors() if hasattr(cache, "tensors") else (cache,)  # QuantizedKV or native.PackedKV


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until touched on the CPU: calloc'd pages (numpy's zeros), which the kernel
    maps as zero pages on first use, instead of torch.zeros' memset of the whole pool at start-up (0.25 s
    for 1 GiB here; most of a pool is never written by a short job)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)
