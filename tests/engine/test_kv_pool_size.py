"""The KV pool's size and how it was chosen (issue 46): on the CPU by default no more than the job's rows can fill
(max_num_seqs rows of max_model_len tokens, else the model's context), at most a ceiling; --kv-cache-gb sets it;
the start line says the size in memory and which rule chose it."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.config import KvPool, KvSizing
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.worker.kv_budget import pool_size
from batchjob.engine.worker.kv_cache import KVCache
from batchjob.job.options.config import JobConfig
from batchjob.job.engine_setup import CPU_KV_CEILING_GB, engine_for
from batchjob.job.report.summary import kv_words, start_line

MIB = 1 << 20


def test_by_default_the_pool_holds_every_row_at_its_longest_and_no_more(tiny_model):
    per_block = KVCache.bytes_per_block(tiny_model, 16)
    sched = SchedulerConfig(max_num_seqs=8, max_model_len=100)
    engine = Engine(tiny_model, [], EngineConfig(kv_cache_fit_rows=True, scheduler=sched))
    pool = engine.kv_pool
    # 8 rows of 100 tokens: 7 blocks of 16 each, plus the scheduler's watermark block
    assert pool == KvPool(8 * 7 + 1, 16, per_block, KvSizing.ROWS, rows=8, row_tokens=100)
    assert engine.pool.num_blocks == pool.blocks and pool.nbytes == 57 * per_block and pool.tokens == 57 * 16
    assert engine.max_model_len == 100  # every row reaches its cap: the pool never shortens one
    # no max_model_len: the model's context (1024 tokens), and a static batch counts its batch size
    static = pool_size(tiny_model, EngineConfig(kv_cache_fit_rows=True, scheduler=SchedulerConfig(static_batch=4)), per_block)
    assert (static.sizing, static.rows, static.row_tokens, static.blocks) == (KvSizing.ROWS, 4, 1024, 4 * 64 + 1)


def test_rows_that_would_take_more_than_the_ceiling_get_the_ceiling(tiny_model):
    per_block = KVCache.bytes_per_block(tiny_model, 16)
    cfg = EngineConfig(kv_cache_bytes=MIB, kv_cache_fit_rows=True, scheduler=SchedulerConfig(max_num_seqs=128))
    pool = pool_size(tiny_model, cfg, per_block)
    assert pool.sizing == KvSizing.CEILING and pool.blocks == MIB // per_block and pool.nbytes <= MIB
    assert pool.rows_bytes == 128 * 64 * per_block > MIB  # what 128 rows of 1024 tokens would have taken


def test_given_bytes_or_blocks_are_the_pool_whatever_the_rows(tiny_model):
    per_block = KVCache.bytes_per_block(tiny_model, 16)
    small = SchedulerConfig(max_num_seqs=2, max_model_len=32)
    given = pool_size(tiny_model, EngineConfig(kv_cache_bytes=MIB, scheduler=small), per_block)
    assert given == KvPool(MIB // per_block, 16, per_block, KvSizing.BYTES)
    assert pool_size(tiny_model, EngineConfig(num_blocks=40, scheduler=small), per_block).sizing == KvSizing.BLOCKS
    # on the CPU gpu_memory_utilization is not read (the CUDA rule needs a device)
    cpu = pool_size(tiny_model, EngineConfig(kv_cache_fit_rows=True, gpu_memory_utilization=0.9, scheduler=small), per_block)
    assert cpu.sizing == KvSizing.ROWS and cpu.blocks == 2 * 2 + 1


def test_a_job_without_kv_cache_gb_sizes_from_its_rows_and_one_with_it_gets_what_it_asked(tiny_model):
    loaded = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_ids=[]))
    per_block = KVCache.bytes_per_block(tiny_model, 16)
    job = dict(model="m", input="in.jsonl", output="out")
    rows = engine_for(JobConfig(**job, max_num_seqs=16, max_model_len=256), loaded, tiny_model).kv_pool
    assert (rows.sizing, rows.blocks) == (KvSizing.ROWS, 16 * 16 + 1)
    ceiling = engine_for(JobConfig(**job, max_num_seqs=1 << 20), loaded, tiny_model).kv_pool
    assert ceiling.sizing == KvSizing.CEILING and ceiling.blocks == int(CPU_KV_CEILING_GB * (1 << 30)) // per_block
    given = engine_for(JobConfig(**job, kv_cache_gb=0.01), loaded, tiny_model).kv_pool
    assert (given.sizing, given.blocks) == (KvSizing.BYTES, int(0.01 * (1 << 30)) // per_block)


def test_the_start_line_says_the_pools_size_and_how_it_was_chosen():
    cfg = JobConfig(model="m", input="in.jsonl", output="out")
    per_block = 12 * 1024  # 768 bytes a token
    rows = KvPool(64 * 128 + 1, 16, per_block, KvSizing.ROWS, rows=64, row_tokens=2048)
    assert kv_words(cfg, rows) == "KV cache 96.0 MiB (64 rows x 2,048 tokens: --max-num-seqs x the model's context; --kv-cache-gb to set)"
    capped = JobConfig(model="m", input="in.jsonl", output="out", max_model_len=2048)
    assert "64 rows x 2,048 tokens: --max-num-seqs x --max-model-len;" in kv_words(capped, rows)
    ceiling = KvPool((1 << 30) // per_block, 16, per_block, KvSizing.CEILING, rows=128, row_tokens=32768)
    assert kv_words(cfg, ceiling) == ("KV cache 1.00 GiB, 1,398,096 tokens (the default's ceiling; 128 rows x 32,768 "
                                      "tokens, --max-num-seqs x the model's context, would take 3.00 GiB; --kv-cache-gb "
                                      "or --max-model-len to change)")
    assert kv_words(cfg, KvPool(100, 16, per_block, KvSizing.BYTES)) == "KV cache 1.2 MiB, 1,600 tokens (--kv-cache-gb)"
    gpu = kv_words(cfg, KvPool(1 << 20, 16, per_block, KvSizing.GPU))
    assert gpu == ("KV cache 12.00 GiB, 16,777,216 tokens (what --gpu-memory-utilization 0.9 leaves after the weights "
                   "and the largest step)")
    model = SimpleNamespace(dtype=torch.float32, kv_cache_dtype="auto", quantization="none",
                            kernels=SimpleNamespace(label="torch"), device=torch.device("cpu"),
                            weight_memory=lambda: {"float32": 3 << 20}, parallel=None)
    line = start_line(cfg, SimpleNamespace(name="m"), model, ["in.jsonl"], 3, 1, "out", rows)
    assert line.endswith("-> out; weights 3.0 MiB (float32); KV cache 96.0 MiB (64 rows x 2,048 tokens: --max-num-seqs x the model's context; "
                         "--kv-cache-gb to set); resuming: 1 of 3 rows committed")
