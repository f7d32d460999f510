"""CUDA graphs' host side, without CUDA: the padded batch sizes, which steps replay a graph, which kernel
sets can be captured, and the flag. The padded static-buffer forward itself runs under the Triton
interpreter in tests/triton_cases.py ("decode CUDA graphs"), and captured on a GPU by `make gpu-check`."""
from __future__ import annotations

import pytest

from batchjob.job.options.config import load_job
from batchjob.engine.worker.cuda_graphs import DecodeGraphs, graph_batch_sizes, padded_size
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.job.engine_setup import build_engine
from batchjob.job.options.resolved import ResolvedJob


def test_graph_sizes_cover_every_batch_up_to_max_num_seqs_with_little_padding():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 8]
    assert graph_batch_sizes(128) == [1, 2, 4, *range(8, 129, 8)]
    big = graph_batch_sizes(1000)
    assert big[-1] == 512 and big[-2] == 496 and 256 in big and 264 not in big
    for max_num_seqs in (1, 3, 8, 100, 128, 300, 512):
        sizes = graph_batch_sizes(max_num_seqs)
        assert sizes == sorted(set(sizes)) and sizes[-1] >= max_num_seqs
        for n in range(1, max_num_seqs + 1):
            b = padded_size(n, sizes)
            assert b >= n and (b - n < 8 if n <= 256 else b - n < 16)
    assert padded_size(513, big) is None


def test_only_a_kernel_set_that_plans_from_shapes_can_be_captured(tiny_model):  # noqa: F811
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=16))
    with pytest.raises(ValueError, match="plan each step on the host: no CUDA graphs.*Triton"):
        DecodeGraphs(tiny_model, engine.runner.kv.layers, 16, 8, 64)
    assert engine.runner.decode_graphs is None  # the CPU runs eagerly whatever the flag


def test_decode_only_steps_up_to_the_largest_size_replay_a_graph():
    from batchjob.kernels.reference.kernel_set import TorchKernels

    class Kernels(TorchKernels):  # a set that plans from shapes alone: all DecodeGraphs asks of it
        name, captures_graphs = "shapes-only", True

        def graph_plan(self, max_context):
            return {"max_context": max_context}

    class Model:
        import torch
        kernels, device = Kernels(), torch.device("cpu")

    graphs = DecodeGraphs(Model(), [], block_size=16, max_num_seqs=6, max_model_len=100, capture=False)
    assert graphs.sizes == [1, 2, 4, 8] and graphs.max_blocks == 7 and graphs.plan == {"max_context": 112}
    assert graphs.block_tables.shape == (8, 7) and graphs.slot_mapping.tolist() == [-1] * 8
    assert graphs.fits([1] * 8) and not graphs.fits([1] * 9) and not graphs.fits([1, 5]) and not graphs.fits([])


def test_the_cuda_graphs_flag_reaches_the_engine(tmp_path, tiny_model_dir):
    from batchjob.models.loader import load_model
    import torch

    for flag in (True, False):
        cfg = load_job(None, {"model": "m", "input": "x.jsonl", "cuda_graphs": flag, "device": "cpu", "dtype": "float32"})
        assert cfg.cuda_graphs is flag
        loaded = load_model(str(tiny_model_dir("llama")), dtype=torch.float32)  # an engine takes its weights
        engine = build_engine(ResolvedJob.of(cfg), loaded)
        assert engine.config.cuda_graphs is flag and engine.runner.decode_graphs is None
