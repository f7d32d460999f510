"""Our model against HF transformers: logits within 1e-4 (fp32) and identical greedy continuations, with the
torch reference kernels and with the native ones."""
from __future__ import annotations

import random
import re
import shutil

import pytest
import torch

from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.core.scheduler import SchedulerConfig, Step
from batchjob.engine.params import SamplingParams
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.worker.input_batch import rows_of, step_inputs
from batchjob.models.registry import build_model
from batchjob.models.causal_lm import CausalLM
from batchjob.models.loader import load_model
from batchjob.models.step_context import StepContext
from tests.builders import TINY_ARCHS

ARCHS = (*TINY_ARCHS, "mistral_window")
HAS_NATIVE = shutil.which("g++") is not None  # the native kernels build on every CPU (vec.h)
# (kernels, KV block size): the native kernels need blocks of a multiple of 16 tokens
KERNELS = [pytest.param(("torch", 8), id="torch"),
           pytest.param(("native", 16), id="native", marks=pytest.mark.skipif(not HAS_NATIVE, reason="needs a C++ compiler"))]


def our_model(path, kernels="auto") -> CausalLM:
    loaded = load_model(str(path), dtype=torch.float32)
    return build_model(loaded.config, dict(loaded.weights), torch.float32, kernels=kernels)


def all_logits(model: CausalLM, prompts: list[list[int]], block_size: int = 8) -> list[torch.Tensor]:
    """Logits of every prompt position, all prompts in ONE flattened forward."""
    engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=block_size))
    seqs = [Sequence(i, p, SamplingParams()) for i, p in enumerate(prompts)]
    step = Step()
    for s in seqs:
        s.block_table = engine.pool.allocate(engine.pool.blocks_for(s.num_tokens))
        step.seqs.append(s)
        step.num_new.append(s.num_tokens)
    runner = engine.runner
    inputs = step_inputs(rows_of(step), runner.block_size, False)
    ids, pos, meta = inputs.input_ids, inputs.positions, inputs.meta
    hidden = model.forward(StepContext(pos, meta, runner.kv.layers, input_ids=ids))
    # prepare() puts 1-token rows (decodes) first; map each row back to its tokens
    order = sorted(range(len(seqs)), key=lambda i: step.num_new[i] != 1)
    out, start = [None] * len(seqs), 0
    for i in order:
        n = step.num_new[i]
        out[i] = model.logits(hidden[start:start + n])
        start += n
    return out


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def prompts(vocab: int, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers_single_and_mixed_batch(arch, kernels, tiny_model_dir):
    name, block_size = kernels
    path = tiny_model_dir(arch)
    ours, ref = our_model(path, name), hf_model(path)
    ps = prompts(ours.config.vocab_size, [1, 7, 33, 64, 120])
    with torch.no_grad():
        expected = [ref(torch.tensor([p])).logits[0].float() for p in ps]
    for p, e in zip(ps, expected):  # one prompt at a time
        (got,) = all_logits(ours, [p], block_size)
        torch.testing.assert_close(got, e, atol=1e-4, rtol=0)
    for got, e in zip(all_logits(ours, ps, block_size), expected):  # all prompts in one mixed batch
        torch.testing.assert_close(got, e, atol=1e-4, rtol=0)
    assert ours.kernels.name == name


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_continuations_match_transformers(arch, kernels, tiny_model_dir):
    name, block_size = kernels
    path = tiny_model_dir(arch, tie_word_embeddings=arch == "qwen2")
    ours, ref = our_model(path, name), hf_model(path)
    ps = prompts(ours.config.vocab_size, [3, 10, 25, 50, 90, 5], seed=1)
    engine = Engine(ours, [], EngineConfig(num_blocks=256, block_size=block_size,
                                           scheduler=SchedulerConfig(max_num_batched_tokens=64)))
    got = engine.generate(ps, SamplingParams(max_tokens=20, ignore_eos=True))
    for p, s in zip(ps, got):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                               pad_token_id=0, eos_token_id=None)
        assert s.output_ids == out[0, len(p):].tolist()


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 2024 I paid 12345 dollars for",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Translate to French: Good morning, how are you?",
    "List three fruits:",
]


@pytest.fixture(scope="module")
def smollm2_hf_greedy(smollm2_loaded, smollm2_hf_model) -> list[list[int]]:
    """transformers' 16 greedy tokens after each of SMOL_PROMPTS: computed once, for every kernel set."""
    outs = []
    for p in (smollm2_loaded.tokenizer.encode(p) for p in SMOL_PROMPTS):
        with torch.no_grad():
            out = smollm2_hf_model.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                            pad_token_id=0, eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
def test_smollm2_gguf_greedy_matches_transformers(kernels, smollm2_loaded, smollm2_hf_greedy):
    loaded = smollm2_loaded
    ours = build_model(loaded.config, dict(loaded.weights), torch.float32, kernels=kernels[0])
    tok = loaded.tokenizer
    ps = [tok.encode(p) for p in SMOL_PROMPTS]
    engine = Engine(ours, [], EngineConfig(num_blocks=256, block_size=16))
    assert ours.kernels.name == kernels[0]
    got = engine.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    for p, s, want in zip(ps, got, smollm2_hf_greedy):
        assert s.output_ids == want, tok.decode(p)
    france = tok.decode(got[0].output_ids)
    assert "Paris" in france


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_input_embeddings_match_transformers_and_undeclared_features_are_refused(arch, tiny_model_dir):
    # the step context's input embeddings replace the lookup as transformers' inputs_embeds do (Gemma: unscaled)
    from batchjob.models.config import UnsupportedModelError

    path = tiny_model_dir(arch)
    model, ref = our_model(path, kernels="torch"), hf_model(path)
    embeds = 0.5 * torch.randn(11, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    engine = Engine(model, [], EngineConfig(num_blocks=64, block_size=8))
    seq = Sequence(0, list(range(3, 14)), SamplingParams())
    seq.block_table = engine.pool.allocate(engine.pool.blocks_for(seq.num_tokens))
    step = Step(seqs=[seq], num_new=[seq.num_tokens])
    inputs = step_inputs(rows_of(step), engine.runner.block_size, False)
    ctx = StepContext(inputs.positions, inputs.meta, engine.runner.kv.layers, inputs_embeds=embeds)
    got = model.logits(model.forward(ctx))
    with torch.no_grad():
        want = ref(inputs_embeds=embeds[None]).logits[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    for refused, name in ((StepContext(inputs.positions[None].expand(3, -1), inputs.meta, engine.runner.kv.layers,
                                       input_ids=inputs.input_ids), "3-D positions"),
                          (StepContext(inputs.positions, inputs.meta, engine.runner.kv.layers, input_ids=inputs.input_ids,
                                       adapter_ids=torch.zeros(11, dtype=torch.int32)), "LoRA adapters")):
        with pytest.raises(UnsupportedModelError, match=f"{arch}: {re.escape(name)}.* not supported by this model family"):
            model.forward(refused)
