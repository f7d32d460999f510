"""What every model file format loads into: a LoadedModel with HF-named weights, checked against its
config (names and shapes); its identity is read in identity.py."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from batchjob.errors import ModelLoadError  # noqa: F401 - raised by every loader, re-exported
from batchjob.models.config import ModelConfig
from batchjob.models.tensor_parallel import TensorShard
from batchjob.models.tokenizer import Tokenizer


@dataclass(slots=True)
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF parameter names, in the requested dtype (a checkpoint's int8 codes:
    # kernels/quantization.py QuantizedWeight; its int4 ones: kernels/linear_quant.py Int4Weight)
    tokenizer: Tokenizer
    identity: dict  # JSON-able: what the model is, for a job fingerprint
    name: str
    # what a pre-quantized checkpoint fixes (kernels/quantization.py resolved_quantization): "int8" (its int8
    # codes are the model's: it runs int8), "fp8" (its fp8 codes are: the loader was told the device computes
    # fp8, kernels/quantization.py keeps_fp8_codes; it runs fp8), "int4" (its W4A16 codes, kernels/linear_quant.py
    # Int4Weight: it runs int4), "dequantized" (fp8 elsewhere, or another weight-only scheme, dequantized at load:
    # it runs in the compute dtype), None (a float checkpoint or a GGUF file: any --quantization)
    quantization: str | None = None
    quantization_scheme: str = ""  # the checkpoint's scheme in words, for messages
    # a tensor-parallel rank's load: the slice of the model its weights are (their shapes: shard.shard_config())
    shard: TensorShard | None = None

    @property
    def prequantized(self) -> bool:
        """Whether the weights hold a checkpoint's codes that the model runs as they are (build_model's
        `prequantized`)."""
        return self.quantization in ("int8", "fp8", "int4")


def checked_weights(config: ModelConfig, weights: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
    """Exactly the parameters the config implies, with their shapes; extras (a tied lm_head, rotary buffers) dropped."""
    from batchjob.models.registry import weight_shapes

    expected = weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"{source}: missing weights {', '.join(missing[:5])}{more}")
    wrong = [f"{n} {tuple(weights[n].shape)} != {s}" for n, s in expected.items() if tuple(weights[n].shape) != s]
    if wrong:
        raise ModelLoadError(f"{source}: weights do not match the config: {'; '.join(wrong[:5])}")
    # a bias we would drop changes the math (e.g. Llama's attention_bias on o_proj, mlp_bias): refuse
    ignored = [n for n in weights if n.endswith(".bias") and n not in expected]
    if ignored:
        raise ModelLoadError(f"{source}: biases this engine does not apply: {', '.join(ignored[:5])}")
    return {n: weights[n] for n in expected}
