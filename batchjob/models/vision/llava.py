"""LLaVA-1.5's image encoder: the CLIP vision tower's hidden states at `vision_feature_layer` (the class token
dropped under the "default" strategy, kept under "full"), through the two-layer MLP projector into the language
model's hidden size: one row per placeholder token of the image."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.models.vision.vit import ACTIVATIONS, VisionConfig, VisionTower

# where checkpoints keep the vision weights: llava-hf's on the Hub and transformers 4's save (vision_tower.vision_model.),
# transformers 5's in-memory names (model.vision_tower.) and its save (vision_tower.)
TOWER_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.", "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


def prefix_of(w: dict, prefixes: tuple[str, ...], name: str) -> str:
    """The prefix under which `w` holds `name`."""
    for prefix in prefixes:
        if prefix + name in w:
            return prefix
    raise KeyError(f"no {name} under any of {', '.join(prefixes)}")


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

    def weight_shapes(self, tower: str = TOWER_PREFIXES[0], projector: str = PROJECTOR_PREFIXES[0]) -> dict[str, tuple[int, ...]]:
        """Every vision weight's name (under the given prefixes) and shape."""
        v, t = self.vision.hidden_size, self.text_hidden_size
        out = self.vision.weight_shapes(tower)
        out.update({f"{projector}linear_1.weight": (t, v), f"{projector}linear_2.weight": (t, t)})
        if self.projector_bias:
            out.update({f"{projector}linear_1.bias": (t,), f"{projector}linear_2.bias": (t,)})
        return out


class LlavaImageEncoder:
    def __init__(self, cfg: LlavaVisionConfig, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes the vision tower's and the projector's weights out of `w`."""
        self.cfg = cfg
        self.tower = VisionTower(cfg.vision, w, prefix_of(w, TOWER_PREFIXES, "embeddings.patch_embedding.weight"),
                                 dtype, device)
        projector = prefix_of(w, PROJECTOR_PREFIXES, "linear_1.weight")

        def take(name: str) -> torch.Tensor | None:
            t = w.pop(projector + name, None)
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
