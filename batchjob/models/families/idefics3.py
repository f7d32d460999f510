"""Idefics3 and SmolVLM (`Idefics3ForConditionalGeneration`): a Llama language model whose prompt carries each image
as tiles (the processor's split: batchjob/images/idefics3.py), each tile a run of `image_seq_len` `<image>`
placeholders between `<fake_token_around_image>` and `<row_r_col_c>` / `<global-img>` tokens; a tile's placeholders
take the SigLIP tower's features through the pixel-shuffle connector (models/vision/idefics3.py). The language model
is the Llama family's, built from `text_config`; the image encoder rides on the model (`DecoderLM.image_encoder`)
for the worker to run, one tile at a time."""
from __future__ import annotations

import dataclasses

from batchjob.models import hf_layout as hf
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.families import llama
from batchjob.models.family import Family, VisionLanguage, prefix_renamer
from batchjob.models.vision.idefics3 import TOWER, Idefics3ImageEncoder, Idefics3VisionConfig

# transformers' names (in memory and saved) -> ours
_RENAMES = (("model.text_model.", "model."), ("model.vision_model.", TOWER), ("model.connector.", "connector."))


canonical_name = prefix_renamer(_RENAMES)


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    text = dict(cfg.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind != "llama":
        raise UnsupportedModelError(f"{source}: an Idefics3 model with a {kind!r} language model is not supported (llama)")
    try:
        vision = Idefics3VisionConfig.from_hf(cfg, source)  # checked here, before any weight is read
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    base = llama.parse_hf(text, "llama", source)
    return dataclasses.replace(base, architecture="idefics3",
                               extra={**base.extra, "idefics3": {k: v for k, v in cfg.items() if k != "text_config"},
                                      "image_token_id": vision.image_token_id,
                                      "tokens_per_image": vision.image_seq_len})


def vision_config(c: ModelConfig) -> Idefics3VisionConfig:
    return Idefics3VisionConfig.from_hf({**c.extra["idefics3"], "text_config": {"hidden_size": c.hidden_size}}, "config")


_VL = VisionLanguage("llama", hf.weight_shapes, llama.build, vision_config, Idefics3ImageEncoder)

FAMILY = Family(
    name="Idefics3, SmolVLM, SmolVLM2",
    hf_architectures={"Idefics3ForConditionalGeneration": "idefics3", "SmolVLMForConditionalGeneration": "idefics3"},
    model_types={"idefics3": "idefics3", "smolvlm": "idefics3"},
    parse_hf=parse_hf, weight_shapes=_VL.weight_shapes, build=_VL.build, canonical_name=canonical_name)
