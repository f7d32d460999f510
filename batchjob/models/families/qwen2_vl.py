"""Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): the Qwen2
language model with M-RoPE, whose prompt carries each image
as `<|vision_start|>`, one `<|image_pad|>` per merged 2 x 2 patch block, `<|vision_end|>`; the placeholders take
the vision encoder's rows (models/vision/qwen2_vl.py) and (temporal, height, width) positions on the image's grid
(engine/worker/mrope.py), composed into each token's rotary row by `mrope_section` (kernels/reference/rotary.py).
The language model is the Llama family's Qwen2 variant, built from `text_config` (transformers 5) or the top-level
fields (the Hub's configs); the image encoder rides on the model for the worker to run, one image at a time."""
from __future__ import annotations

import dataclasses

from batchjob.models import hf_layout as hf
from batchjob.models.config import ModelConfig, UnsupportedModelError
from batchjob.models.families import llama
from batchjob.models.family import Family, VisionLanguage, prefix_renamer
from batchjob.models.step_context import DECODER_FEATURES, ModelFeature
from batchjob.models.vision.qwen2_vl import VISUAL, Qwen2VLImageEncoder, Qwen2VLVisionConfig

# transformers 5's names (in memory and saved) -> the Hub's, which are ours
_RENAMES = (("model.language_model.", "model."), ("model.visual.", VISUAL))


canonical_name = prefix_renamer(_RENAMES)


def parse_hf(cfg: dict, arch: str, source: str) -> ModelConfig:
    text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k != "vision_config"})
    rope = text.get("rope_parameters") or text.get("rope_scaling") or cfg.get("rope_scaling") or {}
    sections = rope.get("mrope_section")
    if not sections or len(sections) != 3:
        raise UnsupportedModelError(f"{source}: a Qwen2-VL config without rope mrope_section (three sections)")
    rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "type", "rope_type")}
    text["rope_parameters"] = {**rope, "rope_type": "default"}
    text.pop("rope_scaling", None)
    try:
        vision = Qwen2VLVisionConfig.from_hf(cfg.get("vision_config") or {}, text["hidden_size"], source)
    except ValueError as e:
        raise UnsupportedModelError(str(e)) from None
    base = llama.parse_hf(text, "qwen2", source)
    return dataclasses.replace(base, architecture="qwen2_vl", extra={
        **base.extra, "qwen2_vl_vision": cfg.get("vision_config") or {}, "image_token_id": cfg.get("image_token_id", 151655),
        "mrope_section": tuple(sections), "mrope_merge": vision.merge_size})


def vision_config(c: ModelConfig) -> Qwen2VLVisionConfig:
    return Qwen2VLVisionConfig.from_hf(c.extra["qwen2_vl_vision"], c.hidden_size, "config")


_VL = VisionLanguage("qwen2", hf.weight_shapes, llama.build, vision_config, Qwen2VLImageEncoder)

FAMILY = Family(
    name="Qwen2-VL, Qwen2.5-VL",
    hf_architectures={"Qwen2VLForConditionalGeneration": "qwen2_vl", "Qwen2_5_VLForConditionalGeneration": "qwen2_vl"},
    model_types={"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_vl"},
    parse_hf=parse_hf, weight_shapes=_VL.weight_shapes, build=_VL.build, canonical_name=canonical_name,
    features=DECODER_FEATURES | {ModelFeature.MROPE})
