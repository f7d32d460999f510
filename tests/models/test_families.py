"""The families beyond Llama (Gemma 2, Gemma 3 text, Phi-3, OLMo 2, Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers as the reference:
greedy text identical in fp32 on tiny random models, on the torch references and on the native kernels
(where the family's ops are native); a row's bf16 sampled text the same alone and in a batch."""
from __future__ import annotations

import json
import random
import shutil
import sys

import pytest
import torch

from batchjob.engine.core.scheduler import SchedulerConfig
from batchjob.engine.params import SamplingParams
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.models import registry
from batchjob.models.loader import load_model
from tests.background import BackgroundRun, starts_early

FAMILIES = ("gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe")
HAS_NATIVE = shutil.which("g++") is not None  # the native kernels build on every CPU (vec.h)
KERNELS = ["torch"] + (["native"] if HAS_NATIVE else [])


def prompts(vocab: int, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(path, ps, n):
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    outs = []
    for p in ps:
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                               eos_token_id=None)
        outs.append(out[0, len(p):].tolist())
    return outs


PROMPTS = prompts(400, [3, 10, 30, 50, 5], seed=2)  # 30 and 50 run past Gemma's 24-token window
# under the interpreter a decode step costs in proportion to its rows: the short prompt and the two past the window
TRITON_ROWS = [0, 2, 3]
TRITON_FAMILIES = BackgroundRun([sys.executable, "-m", "tests.models.triton_families",
                                 json.dumps([PROMPTS[i] for i in TRITON_ROWS]), "8", *FAMILIES])


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    """(folder, prompts, transformers' greedy continuations) per family, computed once."""
    made = {}
    for arch in FAMILIES:
        path = tiny_model_dir(arch, tie_word_embeddings=arch.startswith("gemma"))
        made[arch] = (path, PROMPTS, hf_greedy(path, PROMPTS, 16))
    return made


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_greedy_text_matches_transformers(arch, kernels, references):
    path, ps, expected = references[arch]
    loaded = load_model(str(path), dtype=torch.float32)
    model = registry.build_model(loaded.config, loaded.weights, torch.float32, kernels=kernels)
    assert model.kernels.name == kernels and model.kernels.reference_ops() == []
    engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=16, scheduler=SchedulerConfig(max_num_batched_tokens=48)))
    got = engine.generate(ps, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [s.output_ids for s in got] == expected


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen2_moe"])  # a new dense family, an MoE family
def test_a_rows_sampled_bf16_text_is_the_same_alone_and_in_a_batch(arch, references):
    path, ps, _ = references[arch]
    loaded = load_model(str(path), dtype=torch.bfloat16)
    model = registry.build_model(loaded.config, loaded.weights, torch.bfloat16)
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, ignore_eos=True)

    def run(rows):
        engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=16))
        return [s.output_ids for s in engine.generate(rows, params, seed=3)]

    batched = run(ps)
    assert [run([p])[0] for p in ps[:1]] == batched[:1]  # row 0 alone = row 0 among four others
    assert run(ps[:3]) == batched[:3]


def test_an_unsupported_architecture_is_one_line_listing_the_supported(tmp_path):
    from batchjob.models.config import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="'BertForMaskedLM'.*supported: .*Gemma3ForCausalLM.*Olmo2ForCausalLM"):
        registry.config_from_hf({"architectures": ["BertForMaskedLM"], "model_type": "bert"})


@starts_early(TRITON_FAMILIES)  # the interpreter: one Python thread for minutes, beside the rest of the suite
def test_greedy_text_on_the_triton_kernels_matches_transformers(references):
    """Under the Triton interpreter (CPU), every family: the first 8 of transformers' 16 greedy tokens, for the
    prompts of 3, 30 and 50 tokens (the last two past Gemma's window already; the interpreter's steps are slow). The
    process builds its own folders with the suite's builders: their weights are checked to be the bytes transformers
    ran here."""
    import json

    from tests.builders import weights_digest

    proc = TRITON_FAMILIES.result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for a in FAMILIES:
        path, ps, expected = references[a]
        assert ps == PROMPTS and got[a]["sha256"] == weights_digest(path), a
        assert got[a]["ids"] == [expected[i][:8] for i in TRITON_ROWS], a


@pytest.mark.parametrize("kernels", KERNELS)
def test_phi3_longrope_matches_transformers_on_either_side_of_its_original_context(kernels, tiny_model_dir):
    """Longrope (pre-trained for 32 positions here, max 256): a job whose context stays within 32 rotates with
    the short factors, as transformers does for rows that never pass 32; one with a longer context uses the
    long factors, as transformers does for a prompt longer than 32."""
    path = tiny_model_dir("phi3_longrope")
    loaded = load_model(str(path), dtype=torch.float32)
    assert loaded.config.long_rope.original == 32
    short_rows, long_rows = prompts(400, [3, 10, 20], seed=4), prompts(400, [33, 40, 60], seed=5)
    for rows, context, n in ((short_rows, 32, 8), (long_rows, 256, 12)):
        rows = [r for r in rows if len(r) + n <= context]
        model = registry.build_model(loaded.config, dict(loaded.weights), torch.float32, kernels=kernels)
        engine = Engine(model, [], EngineConfig(num_blocks=64, block_size=16,
                                                scheduler=SchedulerConfig(max_num_batched_tokens=48, max_model_len=context)))
        got = engine.generate(rows, SamplingParams(max_tokens=n, ignore_eos=True))
        assert [s.output_ids for s in got] == hf_greedy(path, rows, n), context
