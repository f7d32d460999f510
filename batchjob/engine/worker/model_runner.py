"""ModelRunner: the in-process Executor (executor.py). Runs one scheduled step (a SchedulerOutput), eagerly or as a
replayed CUDA graph: the step's differences into its persistent batch of rows (input_batch.py InputBatch), their
flat inputs through the staging buffers onto the device, one forward over the KV cache (kv_cache.py) with the
step's context, the logits of the rows that sample, and one sampling pass over them. It reads no engine Sequence:
what it knows of a row is what the scheduler outputs sent it."""
from __future__ import annotations

import time

import torch

from batchjob.engine.core.scheduler_output import SchedulerOutput
from batchjob.engine.sample import sampler
from batchjob.engine.worker.cuda_graphs import DecodeGraphs
from batchjob.engine.worker.encoder import EncoderCache, EncoderStats, step_embeds
from batchjob.engine.worker.mrope import step_positions
from batchjob.engine.worker.input_batch import CachedRow, InputBatch, step_inputs
from batchjob.engine.worker.kv_cache import KVCache
from batchjob.engine.worker.pooler import pool_step
from batchjob.engine.worker.prompt_logprobs import PromptLogprobChunk, score_step
from batchjob.engine.worker.staging import StagingBuffers
from batchjob.kernels import AttentionMetadata
from batchjob.kernels.profiling import scope
from batchjob.models.step_context import ModelFeature, StepContext


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 graphs: tuple[int, int] | None = None, encoder_cache_tokens: int = 0, samples: bool = True):
        """`graphs`: (most rows in a step, the longest row) to replay decode steps as CUDA graphs (the model's
        kernels must capture them). `samples`: False on a tensor-parallel rank other than the first (its steps
        compute their share of the forward and the logits; rank 0 samples, and the tokens reach this rank with the
        next step's rows: engine/worker/tensor_parallel.py)."""
        self.samples = samples
        model.fit_kernels(block_size)
        self.model = model
        self.block_size = block_size
        self.kv = KVCache(model, num_blocks, block_size, num_host_blocks)
        self.staging = StagingBuffers(model.device)
        self.decode_graphs = None if graphs is None else DecodeGraphs(model, self.kv.layers, block_size, *graphs)
        self.model_s = 0.0  # seconds inside the model (forward + logits), summed: the rest of a step is ours
        self.encoder = EncoderStats()  # image placeholder runs encoded and the encoder's seconds (inside model_s)
        self.encoder_cache = EncoderCache(encoder_cache_tokens)  # encoder outputs by image digest, across rows
        self.batch = InputBatch()  # the rows the engine sent, kept between steps until it releases them

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> int:
        """Copy KV blocks to the host pool and back (preemption by swap); returns the blocks moved."""
        return self.kv.swap(swap_out, swap_in)

    def release(self, seq_ids) -> None:
        """Rows the engine is done with: what the worker kept of them goes."""
        self.batch.release(seq_ids)

    def to_device(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """A step's inputs and metadata (in place) through the staging buffers onto the model's device."""
        if self.model.device.type == "cpu":
            return input_ids, positions
        stage = self.staging.to_device
        for name in ("block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
            setattr(meta, name, stage(name, getattr(meta, name)))
        if meta.key_ends is not None:  # a step with a bidirectional image run (Gemma 3); its host copy stays
            meta.key_ends = stage("key_ends", meta.key_ends)
        return stage("input_ids", input_ids), stage("positions", positions)

    def _staged(self, mask) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A step's grammar bitmask, once filled, onto the device through the pinned staging buffers."""
        if mask is None:
            return None
        bitmask, rows = mask.wait()
        return self.staging.to_device("grammar_bitmask", bitmask), self.staging.to_device("grammar_rows", rows)

    def run(self, out: SchedulerOutput, in_flight: StepTokens | None = None) -> StepTokens:
        """One forward over the step, launched; returns its sampled tokens (None for mid-prompt chunks) as a
        handle whose `tolist()` waits for them. On a GPU the host is free until then; on the CPU the forward
        has run by the time this returns. `in_flight`: the step launched before this one, whose tokens are
        not back yet (async scheduling): a row whose last input is its placeholder reads the id that step
        sampled, on the device."""
        self.staging.next_step()
        step = self.batch.update(out)
        with scope("prepare"):
            inputs = step_inputs(step, self.block_size, self.model.device.type != "cpu")
        input_ids, positions = self.to_device(inputs.input_ids, inputs.positions, inputs.meta)
        meta, last = inputs.meta, inputs.last
        fill = None
        if inputs.placeholder_rows:
            assert in_flight is not None, "a placeholder with no step in flight to fill it"
            fill = _placeholder_fill(step, inputs.placeholder_rows, last, in_flight, self.staging)
        argmax = self.model.kernels.argmax
        graphs = self.decode_graphs
        if ModelFeature.MROPE in self.model.features:  # 3-D positions (Qwen2-VL); decode graphs take 1-D ones
            positions, graphs = step_positions(step, last, positions, self.model.config.extra["mrope_merge"]), None
        ids = [r.seq_id for r in step]
        embeds = any(r.params.pooling is not None for r in step)
        # rows scoring prompt positions in this step (a decode-only step has none)
        scores = any(r.params.prompt_logprobs is not None and r.num_computed < r.num_prompt - 1 for r in step)
        if (graphs is not None and not embeds and not scores and inputs.adapter_ids is None and graphs.fits(out.num_new)
                and all(r.num_sampled == 1 for r in step)):  # every row computes one token and samples it
            t0 = time.perf_counter()
            logits = graphs.run(input_ids, positions, meta, fill)
            self.model_s += time.perf_counter() - t0
            with scope("sampler"):
                sampled = sampler.sample(logits, step, argmax=argmax, mask=self._staged(out.grammar))
            return StepTokens(len(step), list(range(len(step))), sampled, seq_ids=ids)
        if fill is not None:
            input_ids[fill[0]] = fill[1]
        # rows whose tokens are all computed sample one token; a speculating row samples at its last token
        # and at each of its k proposals (it computes k tokens past its own)
        rows, spans, at, sampling = [], [], [], []
        for i, r in enumerate(step):
            if r.num_sampled:
                rows.append(i)
                spans.append(r.num_sampled)
                at.extend(range(last[i] - r.num_sampled + 1, last[i] + 1))
                sampling.extend([r] * r.num_sampled)
        t0 = time.perf_counter()
        image_embeds = (step_embeds(self.model, step, last, input_ids, self.encoder, self.encoder_cache)
                        if any(r.images for r in step) else None)
        adapter_ids = None if inputs.adapter_ids is None else self.staging.to_device("adapter_ids", inputs.adapter_ids)
        hidden = self.model.forward(StepContext(positions, meta, self.kv.layers, inputs_embeds=image_embeds,
                                                input_ids=None if image_embeds is not None else input_ids,
                                                adapter_ids=adapter_ids))
        # the logits stay on the model's device: sampling runs there and only token ids come back
        logits = self.model.raw_logits(hidden[self.staging.to_device("logit_rows", torch.tensor(at))]) if rows else None
        pooled = pool_step(hidden, step, last) if embeds else []
        scored = score_step(self.model, hidden, step, last) if scores else []
        self.model_s += time.perf_counter() - t0
        if not rows or not self.samples:
            return StepTokens(len(step), rows, None, seq_ids=ids, pooled=pooled, scored=scored)
        offsets = [j for span in spans for j in range(span)] if len(sampling) > len(rows) else None
        with scope("sampler"):
            sampled = sampler.sample(logits, sampling, argmax=argmax, offsets=offsets, mask=self._staged(out.grammar))
        return StepTokens(len(step), rows, sampled, spans if offsets else None, seq_ids=ids, pooled=pooled,
                          scored=scored)


def _placeholder_fill(step: list[CachedRow], waiting: list[int], last: list[int], in_flight: StepTokens,
                      staging: StagingBuffers) -> tuple:
    """(batch positions, ids) for the step rows in `waiting`, whose last input is a placeholder: the ids
    `in_flight` sampled for them, still on the device."""
    index = {seq_id: j for j, seq_id in enumerate(in_flight.sampled_ids())}
    at = [last[i] for i in waiting]
    src = [index[step[i].seq_id] for i in waiting]
    ids = in_flight.sampled.ids
    return staging.to_device("fill_at", torch.tensor(at)), ids[staging.to_device("fill_src", torch.tensor(src))]


class StepTokens:
    """A launched step's sampled tokens per row: `tolist()` waits for them. None for mid-prompt chunks, an
    int for a row that sampled one token, a list for a speculating row (one token per verified position)."""

    __slots__ = ("num_rows", "rows", "sampled", "spans", "seq_ids", "pooled", "scored")

    def __init__(self, num_rows: int, rows: list[int], sampled: sampler.SampledTokens | None,
                 spans: list[int] | None = None, seq_ids: list[int] | None = None,
                 pooled: list[tuple[int, torch.Tensor]] | None = None,
                 scored: list[PromptLogprobChunk] | None = None):
        self.num_rows, self.rows, self.sampled, self.spans = num_rows, rows, sampled, spans
        self.seq_ids = seq_ids or []  # the step's rows, in step order
        self.pooled = pooled or []  # (step row, vector on the device): embed rows whose last chunk ran
        self.scored = scored or []  # the prompt positions this step scored, per row asking for prompt logprobs

    def embeddings(self) -> dict[int, list[float]]:
        """Step row -> its embedding, for the embed rows the step finished (waits for them)."""
        return {i: vec.cpu().tolist() for i, vec in self.pooled}

    def prompt_logprobs(self) -> dict[int, tuple[int, list]]:
        """Step row -> (first position scored, its entries: PromptLogprobChunk.tolist()); waits for them."""
        return {c.row: (c.start, c.tolist()) for c in self.scored}

    def sampled_ids(self) -> list[int]:
        """The row (its seq id) of each sampled token, in the order of `sampled.ids` (rows of one token only)."""
        assert self.spans is None, "a speculating step is never in flight"
        return [self.seq_ids[i] for i in self.rows]

    def logprobs(self) -> dict[int, list]:
        """Step row -> the logprob entries of the tokens it sampled (engine/sample/sampler.py LogprobEntry), for
        the rows that asked; waits for the tokens."""
        if self.sampled is None:
            return {}
        entries = self.sampled.logprobs()
        if not entries:
            return {}
        out: dict[int, list] = {}
        j = 0
        for i, span in zip(self.rows, self.spans or [1] * len(self.rows)):
            got = [entries[k] for k in range(j, j + span) if k in entries]
            if got:
                out[i] = got
            j += span
        return out

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
