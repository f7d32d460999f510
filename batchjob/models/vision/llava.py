"""LLaVA-1.5's image encoder: the CLIP vision tower's hidden states at `vision_feature_layer` (the class token
dropped under the "default" strategy, kept under "full"), through the two-layer MLP projector into the language
model's hidden size: one row per placeholder token of the image."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.models.vision.vit import ACTIVATIONS, VisionConfig, VisionTower

# where the encoder takes its weights from (llava-hf's names on the Hub; the family maps every other checkpoint
# layout to these: models/families/llava.py canonical_name)
TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."


@dataclass(frozen=True, slots=True)
class LlavaVisionConfig:
    vision: VisionConfig
    text_hidden_size: int
    feature_layer: int = -2
    select: str = "default"  # "default": drop the class token; "full": keep it
    projector_act: str = "gelu"
    projector_bias: bool = True
    image_token_id: int = 32000

    @classmethod
    def from_hf(cls, d: dict, source: str) -> LlavaVisionConfig:
        layer = d.get("vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"{source}: vision_feature_layer {layer!r}: only one layer is supported")
        select = d.get("vision_feature_select_strategy", "default")
        if select not in ("default", "full"):
            raise ValueError(f"{source}: vision_feature_select_strategy {select!r} (default or full)")
        act = d.get("projector_hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: projector_hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        return cls(VisionConfig.from_hf(d["vision_config"], source), d["text_config"]["hidden_size"], layer, select,
                   act, d.get("multimodal_projector_bias", True), d.get("image_token_index", d.get("image_token_id", 32000)))

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_patches + (self.select == "full")

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every vision weight's name (under TOWER and PROJECTOR) and shape."""
        v, t = self.vision.hidden_size, self.text_hidden_size
        out = self.vision.weight_shapes(TOWER)
        out.update({f"{PROJECTOR}linear_1.weight": (t, v), f"{PROJECTOR}linear_2.weight": (t, t)})
        if self.projector_bias:
            out.update({f"{PROJECTOR}linear_1.bias": (t,), f"{PROJECTOR}linear_2.bias": (t,)})
        return out


class LlavaImageEncoder:
    def __init__(self, cfg: LlavaVisionConfig, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes the vision tower's and the projector's weights (under TOWER and PROJECTOR) out of `w`."""
        self.cfg = cfg
        self.tower = VisionTower(cfg.vision, w, TOWER, dtype, device)

        def take(name: str) -> torch.Tensor | None:
            t = w.pop(PROJECTOR + name, None)
            return None if t is None else t.to(device=device, dtype=dtype)

        self.linear_1 = (take("linear_1.weight"), take("linear_1.bias"))
        self.linear_2 = (take("linear_2.weight"), take("linear_2.bias"))

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, tokens_per_image, text hidden]."""
        x = self.tower.features(pixel_values, self.cfg.feature_layer)
        if self.cfg.select == "default":
            x = x[:, 1:]
        x = ACTIVATIONS[self.cfg.projector_act](F.linear(x, *self.linear_1))
        return F.linear(x, *self.linear_2)
