"""A row's text may depend only on (model, parameters, seed, row): not on the rows batched with it, since
a resumed job batches rows differently. The sampler guarantees its part (a row's random draws are a
function of seed, row and position); these tests pin the model's part with the native kernels: each
row's logits (seen through its per-token logprobs) bitwise the same alone or in any batch, in any
prefill chunking, with 1 or 2 threads, and after preemption by recompute or swap, in bfloat16 too."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.sample.row_keys import sequence_key
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.models.config import ModelConfig
from batchjob.models.registry import build_model
from batchjob.models.causal_lm import CausalLM

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the native kernels need a C++ compiler (g++)")
DTYPES = [torch.float32, torch.bfloat16]
VOCAB = 384


def tiny_model(dtype: torch.dtype, kernels: str = "native") -> CausalLM:
    """Random weights, SmolLM2's attention shape in small: head_dim 64, 3 query heads per KV head."""
    h, inter, layers = 192, 256, 2
    cfg = ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=h, intermediate_size=inter, num_layers=layers,
                      num_heads=3, num_kv_heads=1, head_dim=64, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(0)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    weights = {"model.embed_tokens.weight": w(VOCAB, h, std=1.0), "model.norm.weight": 1 + w(h, std=0.1), "lm_head.weight": w(VOCAB, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": 1 + w(h, std=0.1), p + "post_attention_layernorm.weight": 1 + w(h, std=0.1),
            p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(64, h), p + "self_attn.v_proj.weight": w(64, h),
            p + "self_attn.o_proj.weight": w(h, h), p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
    model = build_model(cfg, weights, dtype, kernels=kernels)
    assert model.kernels.name == kernels
    return model


PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(random.Random(100 + i).randint(3, 90))] for i in range(20)]
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, logprobs=0)


def generate(model, prompts=PROMPTS, *, num_blocks=2048, threads=None, preempted: list | None = None, **sched) -> list[tuple]:
    """(token ids, per-token logprobs) of each row; the number of preemptions is appended to `preempted`."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        engine = Engine(model, [], EngineConfig(num_blocks=num_blocks, block_size=16, swap_space_bytes=64 << 20,
                                                scheduler=SchedulerConfig(**sched)))
        seqs = [Sequence(i, list(p), PARAMS, rng_key=sequence_key(PARAMS, 5, i)) for i, p in enumerate(prompts)]
        for s in seqs:
            assert engine.add(s) is None
        count = 0
        while engine.has_work:
            engine.step()
            count += engine.last_stats.num_preempted
        if preempted is not None:
            preempted.append(count)
    finally:
        torch.set_num_threads(before)
    return [(tuple(s.output_ids), tuple(lp[1] for lp in s.logprobs)) for s in seqs]


@pytest.fixture(scope="module", params=DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def model_and_batched(request):
    model = tiny_model(request.param)
    return model, generate(model, max_num_seqs=64)


@pytest.mark.parametrize("how", [
    dict(max_num_seqs=1),  # each row alone
    dict(max_num_seqs=7, threads=1),  # other batch-mates, one thread
    dict(max_num_seqs=64, prefill_chunk=5),  # prompts in 5-token chunks
    dict(max_num_seqs=64, max_num_batched_tokens=37),  # chunks the budget leaves
    dict(max_num_seqs=64, num_blocks=24, preemption="recompute"),  # preempted rows recompute their prompt + output
    dict(max_num_seqs=64, num_blocks=24, preemption="swap"),  # preempted rows' KV goes to the host and back
], ids=["alone", "7-rows-1-thread", "chunk-5", "budget-37", "recompute", "swap"])
def test_a_rows_logits_do_not_depend_on_how_it_was_batched(model_and_batched, how):
    model, batched = model_and_batched
    preempted = []
    assert generate(model, preempted=preempted, **how) == batched
    assert preempted[0] > 0 or "preemption" not in how


def test_shuffled_input_order_gives_each_row_the_same_logits(model_and_batched):
    model, batched = model_and_batched
    order = list(range(len(PROMPTS)))
    random.Random(3).shuffle(order)
    engine = Engine(model, [], EngineConfig(num_blocks=2048, block_size=16, scheduler=SchedulerConfig(max_num_seqs=8)))
    seqs = {i: Sequence(i, list(PROMPTS[i]), PARAMS, rng_key=sequence_key(PARAMS, 5, i)) for i in order}
    for i in order:
        engine.add(seqs[i])
    while engine.has_work:
        engine.step()
    assert [(tuple(seqs[i].output_ids), tuple(lp[1] for lp in seqs[i].logprobs)) for i in range(len(PROMPTS))] == batched


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_the_torch_kernels_on_the_cpu_are_batch_invariant_too(dtype):
    """The fallback where nothing compiles (and `--kernels torch`): attention one row at a time, so a row's logits do
    not depend on its batch-mates. The padded, grouped reference (the tests' oracle) does not promise that."""
    model = tiny_model(dtype, kernels="torch")
    prompts = PROMPTS[:10]
    batched = generate(model, prompts, max_num_seqs=64)
    assert generate(model, prompts, max_num_seqs=1) == batched
    assert generate(model, prompts, max_num_seqs=3) == batched  # (not across thread counts: the torch ops split by threads)
