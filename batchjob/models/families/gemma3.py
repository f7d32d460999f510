"""Gemma 3 with images (`Gemma3ForConditionalGeneration`, the 4B-27B releases): the Gemma 3 language model whose
prompt carries each image as `<start_of_image>`, `mm_tokens_per_image` `<image_soft_token>` placeholders and
`<end_of_image>` (blank lines around, as Gemma3Processor writes them: images/layouts.py); the placeholders take the
SigLIP tower's pooled, projected rows (models/vision/gemma3.py) and attend to each other both ways, as transformers
masks them: the run is computed in one step and its tokens see the whole run (ImageSlot.bidirectional,
AttentionMetadata.key_ends). The language model is the Gemma family's Gemma 3 variant, built from `text_config`."""
from __future__ import annotations

import dataclasses

from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.families import gemma
from batchjob.models.family import Family, VisionLanguage, prefix_renamer
from batchjob.models.vision.gemma3 import PROJECTOR, TOWER, Gemma3ImageEncoder, Gemma3VisionConfig

# transformers 5's names (in memory and saved) and transformers 4's saves -> ours (the Hub's, text under `model.`)
_RENAMES = (("model.language_model.", "model."), ("language_model.model.", "model."),
            ("language_model.lm_head.", "lm_head."), ("model.vision_tower.vision_model.", TOWER),
            ("model.vision_tower.", TOWER), ("vision_tower.vision_model.", TOWER), ("vision_tower.", TOWER),
            ("model.multi_modal_projector.", PROJECTOR))

canonical_name = prefix_renamer(_RENAMES)


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    text = {"model_type": "gemma3_text", **(cfg.get("text_config") or {})}
    if text["model_type"] != "gemma3_text":
        raise UnsupportedModelError(f"{source}: a Gemma 3 model with a {text['model_type']!r} language model is not "
                                    "supported (gemma3_text)")
    try:
        vision = Gemma3VisionConfig.from_hf({**cfg, "text_config": text}, source)  # checked before any weight is read
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
    base = gemma.parse_hf(text, "gemma3_text", source)
    return dataclasses.replace(base, architecture="gemma3_vl", extra={
        **base.extra, "gemma3": {k: v for k, v in cfg.items() if k != "text_config"},
        "image_token_id": vision.image_token_id, "boi_token_id": vision.boi_token_id,
        "eoi_token_id": vision.eoi_token_id, "tokens_per_image": vision.tokens_per_image})


def vision_config(c: ModelConfig) -> Gemma3VisionConfig:
    return Gemma3VisionConfig.from_hf({**c.extra["gemma3"], "text_config": {"hidden_size": c.hidden_size}}, "config")


_VL = VisionLanguage("gemma3_text", gemma.weight_shapes, gemma.build, vision_config, Gemma3ImageEncoder)

FAMILY = Family(
    name="Gemma 3 (images)",
    hf_architectures={"Gemma3ForConditionalGeneration": "gemma3_vl"}, model_types={"gemma3": "gemma3_vl"},
    parse_hf=parse_hf, weight_shapes=_VL.weight_shapes, build=_VL.build, canonical_name=canonical_name)
