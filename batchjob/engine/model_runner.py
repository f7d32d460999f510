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
from batchjob.engine.staging import StagingBuffers
from batchjob.kernels import AttentionMetadata
from batchjob.kernels.profiling import scope
from batchjob.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, num_host_blocks: int = 0):
        c = model.config
        model.fit_kernels(block_size)
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        k_shape, v_shape = model.kernels.kv_cache_shapes(num_blocks, block_size, c.num_kv_heads, c.head_dim)
        self.kv_caches = [(_zeros(k_shape, model.dtype, model.device), _zeros(v_shape, model.dtype, model.device))
                          for _ in range(c.num_layers)]
        block_elems = math.prod(k_shape[1:])  # a block's K (or V) values, whatever the layout
        host_shape = (c.num_layers, 2, num_host_blocks, block_elems)
        pin = model.device.type == "cuda"
        # empty, not zeros: every host block is written by a swap-out before it is read, and untouched
        # pages cost no memory or start-up time
        self.host_cache = torch.empty(host_shape, dtype=model.dtype, pin_memory=pin) if num_host_blocks else None
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
            for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
                for j, cache in enumerate((k_cache, v_cache)):
                    host = self.host_cache[layer, j]
                    blocks = cache.view(cache.shape[0], -1)
                    if to_host:
                        host[dst] = blocks[src.to(cache.device)].to("cpu")
                    else:
                        blocks[dst.to(cache.device)] = host[src].to(cache.device, non_blocking=True)
            moved += len(pairs) * self.kv_bytes_per_block(self.model, self.block_size)
        return moved

    @staticmethod
    def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
        c = model.config
        return 2 * c.num_layers * block_size * c.num_kv_heads * c.head_dim * model.dtype.itemsize

    def prepare(self, step: Step) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Returns input_ids, positions, the attention metadata and the batch index of each row's last token.
        Rows are laid out decodes first (one token each), then prompt chunks, as the kernels expect."""
        bs = self.block_size
        order = sorted(range(len(step.seqs)), key=lambda i: step.num_new[i] != 1)
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        last: list[int] = [0] * len(step.seqs)
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for i in order:
            seq, n = step.seqs[i], step.num_new[i]
            start = seq.num_computed
            chunk = seq.token_ids[start:start + n]
            ids.extend(chunk)
            if len(chunk) < n:  # speculative: the row's last token, then its proposals
                ids.extend(seq.draft[:n - len(chunk)])
            rng = range(start, start + n)
            pos.extend(rng)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in rng)
            last[i] = len(ids) - 1
            qsl.append(len(ids))
            seq_lens.append(start + n)
            tables.append(table[:-(-(start + n) // bs)])
        width = max(map(len, tables), default=0)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).view(len(tables), width)
        meta = AttentionMetadata(
            block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.long),
            num_decodes=sum(1 for n in step.num_new if n == 1),
            # on a GPU, kernels plan from these host lists instead of reading the device tensors back (a sync)
            host={"query_start_loc": qsl, "seq_lens": seq_lens, "block_tables": block_tables}
            if self.model.device.type != "cpu" else None,
        )
        return torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long), meta, last

    def run(self, step: Step) -> StepTokens:
        """One forward over the step, launched; returns its sampled tokens (None for mid-prompt chunks) as a
        handle whose `tolist()` waits for them. On a GPU the host is free until then; on the CPU the forward
        has run by the time this returns."""
        device = self.model.device
        with scope("prepare"):
            input_ids, positions, meta, last = self.prepare(step)
        graphs = self.decode_graphs
        if graphs is not None and graphs.fits(step.num_new):  # every row decodes: all of them sample
            t0 = time.perf_counter()
            logits = graphs.run(input_ids, positions, meta)
            self.model_s += time.perf_counter() - t0
            rows = list(range(len(step.seqs)))
            with scope("sampler"):
                sampled = sampler.sample(logits, step.seqs, argmax=getattr(self.model.kernels, "argmax", None))
            return StepTokens(len(rows), rows, sampled)
        if device.type != "cpu":
            stage = self.staging.to_device
            input_ids, positions = stage("input_ids", input_ids), stage("positions", positions)
            for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
                setattr(meta, name, stage(name, getattr(meta, name)))
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
        logits = self.model.raw_logits(hidden[torch.tensor(at, device=device)]) if rows else None
        self.model_s += time.perf_counter() - t0
        if not rows:
            return StepTokens(len(step.seqs), rows, None)
        offsets = [j for span in spans for j in range(span)] if len(seqs) > len(rows) else None
        with scope("sampler"):
            sampled = sampler.sample(logits, seqs, argmax=getattr(self.model.kernels, "argmax", None), offsets=offsets)
        return StepTokens(len(step.seqs), rows, sampled, spans if offsets else None)


class StepTokens:
    """A launched step's sampled tokens per row: `tolist()` waits for them. None for mid-prompt chunks, an
    int for a row that sampled one token, a list for a speculating row (one token per verified position)."""

    __slots__ = ("num_rows", "rows", "sampled", "spans")

    def __init__(self, num_rows: int, rows: list[int], sampled: sampler.SampledTokens | None,
                 spans: list[int] | None = None):
        self.num_rows, self.rows, self.sampled, self.spans = num_rows, rows, sampled, spans

    def __len__(self) -> int:
        return self.num_rows

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


def _zeros(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until touched on the CPU: calloc'd pages (numpy's zeros), which the kernel
    maps as zero pages on first use, instead of torch.zeros' memset of the whole pool at start-up (0.25 s
    for 1 GiB here; most of a pool is never written by a short job)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    n = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(n, dtype=np.uint8)).view(dtype).view(shape)
