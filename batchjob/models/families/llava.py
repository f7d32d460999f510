"""LLaVA-1.5 (`LlavaForConditionalGeneration`): a Llama language model whose prompt carries each image as a run of
`image_token_index` placeholders, their embeddings replaced by the CLIP vision tower's features through the MLP
projector (models/vision/llava.py). The language model is the Llama family's, built from `text_config`; the image
encoder rides on the model (`DecoderLM.image_encoder`) for the worker to run. Checkpoints name the weights several
ways (llava-hf's on the Hub, transformers 4's and 5's saves): `canonical_name` maps each to one."""
from __future__ import annotations

import dataclasses

from batchjob.models import hf_layout as hf
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.families import llama
from batchjob.models.family import Family, VisionLanguage, prefix_renamer
from batchjob.models.vision.llava import PROJECTOR, TOWER, LlavaImageEncoder, LlavaVisionConfig

# checkpoint prefix -> ours (the first that matches): llava-hf's names on the Hub are ours for the vision parts;
# transformers 5 keeps `model.language_model.` / `model.vision_tower.` in memory and saves `vision_tower.` without
# `vision_model.`; transformers 4 saved `language_model.model.` and `language_model.lm_head.`
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", TOWER),
            ("model.vision_tower.", TOWER), ("vision_tower.vision_model.", TOWER), ("vision_tower.", TOWER),
            ("model.multi_modal_projector.", PROJECTOR))


canonical_name = prefix_renamer(_RENAMES)


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    text = dict(cfg.get("text_config") or {})
    kind = text.get("model_type", "llama")
    if kind != "llama":
        raise UnsupportedModelError(f"{source}: a LLaVA model with a {kind!r} language model is not supported (llama)")
    vision = LlavaVisionConfig.from_hf(cfg, source)  # checked here, before any weight is read
    base = llama.parse_hf(text, "llama", source)
    return dataclasses.replace(base, architecture="llava",
                               extra={**base.extra, "llava": {k: v for k, v in cfg.items() if k != "text_config"},
                                      "image_token_id": vision.image_token_id,
                                      "tokens_per_image": vision.tokens_per_image})


def vision_config(c: ModelConfig) -> LlavaVisionConfig:
    return LlavaVisionConfig.from_hf({**c.extra["llava"], "text_config": {"hidden_size": c.hidden_size}}, "config")


_VL = VisionLanguage("llama", hf.weight_shapes, llama.build, vision_config, LlavaImageEncoder)

FAMILY = Family(
    name="LLaVA-1.5",
    hf_architectures={"LlavaForConditionalGeneration": "llava"}, model_types={"llava": "llava"},
    parse_hf=parse_hf, weight_shapes=_VL.weight_shapes, build=_VL.build, canonical_name=canonical_name)
