"""Writes a small random LoRA adapter for the embedded SmolLM2 (rank 8 on q_proj and v_proj of every layer), in PEFT's
folder format, for jobs/lora.toml: random weights, so it changes the text without teaching it anything.

    .venv/bin/python jobs/data/make_lora_adapter.py [FOLDER]      (default: jobs/data/adapters/smollm2-demo)
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, LAYERS, KV = 576, 30, 3 * 64  # SmolLM2-135M: hidden 576, 30 layers, 3 KV heads of 64


def main(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for i in range(LAYERS):
        for module, out in (("q_proj", HIDDEN), ("v_proj", KV)):
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            weights[f"{key}.lora_A.weight"] = torch.randn(8, HIDDEN, generator=g) * 0.05
            weights[f"{key}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.05
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, indent=1))
    print(f"wrote {folder}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "adapters" / "smollm2-demo")
