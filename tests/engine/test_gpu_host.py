"""The GPU step's host-side logic, without CUDA (issue 11): the KV pool sized from the device's memory
after a profiling forward (the arithmetic and the profiling step itself), staging buffers reused from
step to step, and the flags that reach them."""
from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from batchjob.job.options.config import ConfigError, load_job
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.worker.kv_budget import GIB, DeviceMemory, KvBudgetError, blocks_for, kv_cache_bytes, profile_step
from batchjob.engine.core.scheduler_output import WorkerView
from batchjob.engine.worker.input_batch import rows_of, step_inputs
from batchjob.engine.worker.kv_cache import KVCache
from batchjob.engine.worker.model_runner import ModelRunner
from batchjob.engine.worker.staging import MIN_CAPACITY, StagingBuffers


def test_the_kv_pool_gets_what_utilization_leaves_after_the_peak_and_other_memory():
    # 100 GiB device, 90 free after the weights (8 GiB, held by torch), so 2 GiB are the CUDA context and
    # other processes; the profiling forward peaks at 12 GiB (weights + 4 GiB of activations)
    mem = DeviceMemory(total=100 * GIB, free=90 * GIB, torch_reserved=8 * GIB, peak_allocated=12 * GIB)
    assert kv_cache_bytes(mem, 0.9) == 90 * GIB - 2 * GIB - 12 * GIB
    assert kv_cache_bytes(mem, 1.0) == 100 * GIB - 2 * GIB - 12 * GIB
    # another process takes 30 GiB more: the pool shrinks by as much
    busy = DeviceMemory(total=100 * GIB, free=60 * GIB, torch_reserved=8 * GIB, peak_allocated=12 * GIB)
    assert kv_cache_bytes(busy, 0.9) == kv_cache_bytes(mem, 0.9) - 30 * GIB


def test_a_model_that_leaves_no_room_is_a_clear_error():
    mem = DeviceMemory(total=16 * GIB, free=2 * GIB, torch_reserved=13 * GIB, peak_allocated=15 * GIB)
    with pytest.raises(KvBudgetError, match=r"no room for a KV cache: 90% of the GPU's 16.0 GiB.*--gpu-memory-utilization"):
        kv_cache_bytes(mem, 0.9)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(mem, 0)
    assert blocks_for(10 * 4096, 4096, min_blocks=8) == 10
    with pytest.raises(KvBudgetError, match="fits 3 blocks, fewer than the 8 one full-length row needs"):
        blocks_for(3 * 4096 + 5, 4096, min_blocks=8)


def test_the_profiling_step_is_the_largest_the_scheduler_builds_and_runs_through_the_real_runner(tiny_model):  # noqa: F811
    step, used = profile_step(1000, 64, 16)
    assert len(step.seqs) == 64 and sum(step.num_new) == 1000 and max(step.num_new) - min(step.num_new) <= 1
    tables = [b for s in step.seqs for b in s.block_table]
    assert tables == list(range(used)) and used == sum(-(-n // 16) for n in step.num_new)
    small, _ = profile_step(10, 64, 16)  # fewer tokens than rows: one token a row
    assert len(small.seqs) == 10 and small.num_new == [1] * 10
    runner = ModelRunner(tiny_model, used, 16)
    tokens = runner.run(WorkerView().output(step)).tolist()  # a real forward, logits and sampling on the model's device (here the CPU)
    assert len(tokens) == 64 and all(isinstance(t, int) for t in tokens)


def test_on_the_cpu_the_pool_comes_from_kv_cache_bytes_whatever_the_utilization(tiny_model):  # noqa: F811
    a = Engine(tiny_model, [], EngineConfig(kv_cache_bytes=1 << 20, gpu_memory_utilization=0.9))
    b = Engine(tiny_model, [], EngineConfig(kv_cache_bytes=1 << 20))
    assert a.pool.num_blocks == b.pool.num_blocks == (1 << 20) // KVCache.bytes_per_block(tiny_model, 16)


def test_staging_buffers_are_kept_grown_by_doubling_and_skipped_on_the_cpu():
    cpu = StagingBuffers(torch.device("cpu"))
    t = torch.arange(10)
    assert cpu.to_device("ids", t) is t and not cpu.buffers
    # the meta device stands in for a GPU: the host side (buffers, growth, reuse) is the same
    stage = StagingBuffers(torch.device("meta"), pin=False)
    out = stage.to_device("ids", torch.arange(10))
    assert out.device.type == "meta" and out.shape == (10,)
    first = stage.buffers[(0, "ids")]
    assert first.numel() == MIN_CAPACITY and first.device.type == "cpu"
    stage.to_device("ids", torch.arange(200))
    assert stage.buffers[(0, "ids")] is first  # fits: the same buffer, no new allocation
    stage.to_device("ids", torch.arange(MIN_CAPACITY + 1))
    assert stage.buffers[(0, "ids")].numel() == 2 * MIN_CAPACITY  # grown by doubling
    stage.to_device("ids", torch.arange(5000))
    assert stage.buffers[(0, "ids")].numel() == 5000  # or to the need when that is more
    tables = stage.to_device("block_tables", torch.zeros((3, 7), dtype=torch.int32))
    assert tables.shape == (3, 7) and stage.buffers[(0, "block_tables")].dtype == torch.int32
    assert list(stage.buffers[(0, "ids")][:4]) == [0, 1, 2, 3]  # the host copy holds the values sent
    # the next step writes the other set: the one the step in flight reads is left alone
    stage.next_step()
    stage.to_device("ids", torch.arange(7, 17))
    assert list(stage.buffers[(0, "ids")][:4]) == [0, 1, 2, 3] and list(stage.buffers[(1, "ids")][:2]) == [7, 8]
    stage.next_step()
    stage.to_device("ids", torch.arange(3))
    assert list(stage.buffers[(0, "ids")][:3]) == [0, 1, 2]  # two steps later: the first set again


def test_gpu_memory_utilization_is_validated_and_kv_cache_gb_defaults_to_auto(tmp_path):
    from batchjob.cli.main import main

    cfg = load_job(None, {"model": "m", "input": "x.jsonl"})
    assert cfg.kv_cache_gb is None and cfg.gpu_memory_utilization == 0.9
    assert load_job(None, {"model": "m", "input": "x.jsonl", "kv_cache_gb": 2}).kv_cache_gb == 2.0
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="gpu_memory_utilization: must be in"):
            load_job(None, {"model": "m", "input": "x.jsonl", "gpu_memory_utilization": bad})
    with pytest.raises(ConfigError, match="kv_cache_gb: expected a number of GiB"):
        load_job(None, {"model": "m", "input": "x.jsonl", "kv_cache_gb": "lots"})
    result = CliRunner().invoke(main, ["run", "--model", "m", "--input", str(tmp_path / "x.jsonl"),
                                       "--gpu-memory-utilization", "0"])
    assert result.exit_code == 2 and "gpu-memory-utilization" in result.output


def test_the_torch_kernels_plan_from_the_runners_host_copies_with_the_same_result(tiny_model):  # noqa: F811
    """On a GPU the runner hands host copies of the offsets and block tables (no read-back per step); the
    torch reference's plan from them is the plan from the tensors."""
    from batchjob.kernels import AttentionMetadata
    from batchjob.kernels.reference.kernel_set import TorchKernels

    step, used = profile_step(40, 5, 16)
    runner = ModelRunner(tiny_model, used, 16)
    inputs = step_inputs(rows_of(step), 16, runner.model.device.type != "cpu")
    ids, positions, meta = inputs.input_ids, inputs.positions, inputs.meta
    assert meta.host is None  # the CPU needs no copies
    g = torch.Generator().manual_seed(0)
    shape, _ = TorchKernels().kv_cache_shapes(used, 16, 2, 16)
    kc, vc = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    q = torch.randn(40, 4, 16, generator=g)
    # the tensors scrambled: only a plan built from the host copies gets the right answer
    hosted = AttentionMetadata(torch.zeros_like(meta.block_tables), meta.seq_lens.flip(0), meta.query_start_loc.flip(0),
                               meta.slot_mapping, meta.num_decodes,
                               host={"query_start_loc": meta.query_start_loc.tolist(), "seq_lens": meta.seq_lens.tolist(),
                                     "block_tables": meta.block_tables.clone()})
    assert torch.equal(TorchKernels().attention(q, kc, vc, hosted, 0.25), TorchKernels().attention(q, kc, vc, meta, 0.25))
