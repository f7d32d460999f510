"""The benchmark's models, as HF folders every system loads the same weights from: a tiny random Llama
built here (seeded) and SmolLM2-135M converted once from its GGUF. Both are cached in the bench cache (bench/paths.py: a checkout's bench/cache)."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from batchjob.bench.paths import CACHE

TINY = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    name: str  # tiny | smollm2
    path: str  # HF folder (config.json + model.safetensors + tokenizer.json)
    hidden: int
    intermediate: int
    layers: int
    q_size: int
    kv_size: int
    vocab: int

    def matmul_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every weight matmul one token goes through, lm_head included (a generated token needs it)."""
        h = self.hidden
        per_layer = [(h, self.q_size + 2 * self.kv_size), (self.q_size, h), (h, 2 * self.intermediate), (self.intermediate, h)]
        return per_layer * self.layers + [(h, self.vocab)]

    @property
    def matmul_params(self) -> int:
        return sum(i * o for i, o in self.matmul_shapes())

    @property
    def matmul_params_no_head(self) -> int:
        return self.matmul_params - self.hidden * self.vocab


def spec_from_folder(name: str, folder: Path) -> ModelSpec:
    c = json.loads((folder / "config.json").read_text())
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    return ModelSpec(name, str(folder), c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                     heads * head_dim, kv * head_dim, c["vocab_size"])


def prepare(name: str, cache: Path = CACHE) -> ModelSpec:
    """Build (once) and return the model's HF folder."""
    folder = cache / name
    if not (folder / "model.safetensors").is_file():
        tmp = cache / f".{name}.{os.getpid()}.tmp"  # per process: two benchmarks may build at once
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        {"tiny": _build_tiny, "smollm2": _convert_smollm2}[name](tmp)
        if (folder / "model.safetensors").is_file():  # another process finished first: same seeded weights
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
    return spec_from_folder(name, folder)


def _build_tiny(folder: Path) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**TINY)).eval().save_pretrained(folder)
    _word_tokenizer(folder, TINY["vocab_size"])
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def _word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over the whole vocabulary ("<unk>", "<s>", "</s>", "w3", "w4", ...), so any
    id the random model samples decodes; the pipeline benchmark feeds it text like "w17 w923"."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "pad_token": "</s>", "add_bos_token": False}))


def _convert_smollm2(folder: Path) -> None:
    """transformers' own GGUF conversion (dequantized Q4_1 -> fp32), saved as safetensors: ~20 s once,
    then every system (ours included) loads the same fp32 weights from this folder in about a second."""
    import torch
    import transformers as tf

    from batchjob.models.loader import resolve_model_path

    gguf = resolve_model_path("smollm2")
    from safetensors.torch import save_file

    model = tf.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a GGUF-loaded model ("quantized ... not serializable"); the weights are plain
    # fp32 by now, so write them and the config directly
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    model.generation_config.to_json_file(str(folder / "generation_config.json"))
    tok = tf.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.save_pretrained(folder)
