"""CUDA graphs for decode-only steps. A decode step launches a few hundred small kernels (about ten per
layer) whose launch cost, not their work, bounds a small model's step on a GPU; a captured graph replays
them all with one launch.

A step of n decode rows runs the graph captured for the smallest padded size b >= n (1, 2, 4, 8, then
steps of 8 to 256 and of 16 to 512, as vLLM pads). The graph reads static buffers (input ids, positions,
slot mapping, block tables as wide as the longest row can need, context lengths), refilled before each
replay; the b - n padding rows have context 0 (attention reads nothing, writes zeros) and slot -1 (the
KV store skips them), so they touch no row's cache. Only kernel sets that plan a decode step from its
shapes alone (`graph_plan`: the Triton kernels) can be captured; mixed and prefill steps, and batches
over the largest size, run eagerly. Graphs are captured at a size's first use, in one memory pool.

`capture=False` runs the same padded static-buffer forward without a graph: the host-side logic of a
replay, testable on the CPU (tests/engine/test_cuda_graphs.py)."""
from __future__ import annotations

import bisect
import time

import torch

from batchjob.kernels import AttentionMetadata
from batchjob.models.step_context import StepContext

LARGEST = 512


def graph_batch_sizes(max_num_seqs: int, largest: int = LARGEST) -> list[int]:
    """The padded batch sizes with a graph: enough that a batch of up to min(max_num_seqs, largest) rows
    has one, none much larger than needed."""
    ladder = [1, 2, 4, *range(8, 257, 8), *range(272, LARGEST + 1, 16)]
    cap = max(1, min(max_num_seqs, largest))
    sizes = [s for s in ladder if s < cap]
    sizes.append(ladder[bisect.bisect_left(ladder, cap)])
    return sizes


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The graph size a batch of n rows runs at (None: more rows than the largest graph)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphs:
    def __init__(self, model, kv_caches, block_size: int, max_num_seqs: int, max_model_len: int, capture: bool = True):
        if not model.kernels.captures_graphs:
            raise ValueError(f"the {model.kernels.name} kernels plan each step on the host: no CUDA graphs "
                             "(they need the Triton kernels: --kernels triton or auto)")
        self.model, self.kv_caches, self.capture = model, kv_caches, capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.plan = model.kernels.graph_plan(self.max_blocks * block_size)
        b, dev = self.sizes[-1], model.device
        self.input_ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((b, self.max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)  # one query token a row
        self.graphs: dict[int, tuple] = {}  # size -> (graph, its logits tensor)
        self.pool = None
        self.capture_s = 0.0  # time spent capturing, summed
        self.replays = 0

    def fits(self, num_new: list[int]) -> bool:
        return bool(num_new) and len(num_new) <= self.sizes[-1] and all(n == 1 for n in num_new)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            fill: tuple | None = None) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only step; inputs are step_inputs', already on the device
        (copied into the static buffers device to device), and `fill` (batch positions, ids on the device)
        the ids of placeholders (async scheduling)."""
        n = input_ids.shape[0]
        b = padded_size(n, self.sizes)
        if self.capture and b not in self.graphs:
            self._capture(b)
        self._fill(n, b, input_ids, positions, meta)
        if fill is not None:
            self.input_ids[fill[0]] = fill[1]
        self.replays += 1
        if not self.capture:
            return self._forward(b)[:n]
        graph, logits = self.graphs[b]
        graph.replay()
        return logits[:n]

    def _fill(self, n: int, b: int, input_ids, positions, meta: AttentionMetadata) -> None:
        nb = self.model.device.type == "cuda"
        self.input_ids[:n].copy_(input_ids, non_blocking=nb)
        self.positions[:n].copy_(positions, non_blocking=nb)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=nb)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=nb)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=nb)
        if b > n:  # padding rows: no context, no KV store (their ids, positions and tables are never read)
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].zero_()

    def _forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata(block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
                                 query_start_loc=self.query_start_loc[:b + 1], slot_mapping=self.slot_mapping[:b],
                                 num_decodes=b)
        meta.plans.update(self.plan)  # planned from shapes, not from this step's lengths: valid at every replay
        hidden = self.model.forward(StepContext(self.positions[:b], meta, self.kv_caches, input_ids=self.input_ids[:b]))
        return self.model.raw_logits(hidden)

    def _capture(self, b: int) -> None:
        t0 = time.perf_counter()
        self.slot_mapping[:b].fill_(-1)  # capture (and its warm-up runs) touch no row's cache
        self.seq_lens[:b].zero_()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: Triton compiles, the allocator settles
            for _ in range(2):
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(b)
        self.graphs[b] = (graph, logits)
        self.capture_s += time.perf_counter() - t0
