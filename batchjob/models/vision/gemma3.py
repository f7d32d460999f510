"""Gemma 3's image encoder: a SigLIP tower at its fixed size (896 px in the released models) whose last hidden states
go through the tower's post-norm, then the multimodal projector: the patch grid average-pooled to
`mm_tokens_per_image` rows (64 x 64 patches -> 16 x 16), an RMSNorm of Gemma's `x * (1 + w)` kind in fp32, and one
matmul into the language model's hidden size. One image in, `mm_tokens_per_image` rows out: one per
`<image_soft_token>` placeholder between the image's `<start_of_image>` and `<end_of_image>`."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.models.vision.vit import VisionConfig, VisionTower

# where the encoder takes its weights from (the Hub's names; the family maps transformers 5's to these:
# models/families/gemma3.py canonical_name)
TOWER, PROJECTOR = "vision_tower.vision_model.", "multi_modal_projector."


@dataclass(frozen=True, slots=True)
class Gemma3VisionConfig:
    vision: VisionConfig
    text_hidden_size: int
    tokens_per_image: int = 256  # mm_tokens_per_image
    image_token_id: int = 262144  # <image_soft_token>: the placeholders
    boi_token_id: int = 255999  # <start_of_image>: what the chat template writes for an image
    eoi_token_id: int = 256000  # <end_of_image>

    @classmethod
    def from_hf(cls, d: dict, source: str) -> Gemma3VisionConfig:
        vision = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                  "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 896,
                  **(d.get("vision_config") or {})}  # Gemma3Config's vision defaults
        # SigLIP's last hidden states as transformers' SiglipVisionModel gives them: through its post-layernorm; its
        # pooling head (vision_use_head, SiglipVisionConfig's default; the released Gemma 3 configs turn it off) is in
        # a checkpoint that has one, never read
        tower = dataclasses.replace(VisionConfig.from_hf(vision, source), post_norm=True,
                                    pooling_head=bool(vision.get("vision_use_head", True)))
        cfg = cls(tower, d["text_config"]["hidden_size"], d.get("mm_tokens_per_image", 256),
                  d.get("image_token_index", d.get("image_token_id", 262144)), d.get("boi_token_index", 255999),
                  d.get("eoi_token_index", 256000))
        side, per_side = tower.image_size // tower.patch_size, math.isqrt(cfg.tokens_per_image)
        if per_side * per_side != cfg.tokens_per_image or side % per_side:
            raise ValueError(f"{source}: mm_tokens_per_image {cfg.tokens_per_image} does not pool a {side} x {side} "
                             "patch grid evenly (a square number whose side divides it)")
        return cfg

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        out = self.vision.weight_shapes(TOWER)
        out[f"{PROJECTOR}mm_input_projection_weight"] = (self.vision.hidden_size, self.text_hidden_size)
        out[f"{PROJECTOR}mm_soft_emb_norm.weight"] = (self.vision.hidden_size,)
        return out


class Gemma3ImageEncoder:
    def __init__(self, cfg: Gemma3VisionConfig, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes the tower's and the projector's weights (under TOWER and PROJECTOR) out of `w`."""
        self.cfg = cfg
        self.tower = VisionTower(cfg.vision, w, TOWER, dtype, device)
        self.proj = w.pop(f"{PROJECTOR}mm_input_projection_weight").to(device=device, dtype=dtype)  # [vision, text]
        self.norm = w.pop(f"{PROJECTOR}mm_soft_emb_norm.weight").to(device=device, dtype=torch.float32)
        side = cfg.vision.image_size // cfg.vision.patch_size
        self.side, self.kernel = side, side // math.isqrt(cfg.tokens_per_image)

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> [B, tokens_per_image, text hidden]."""
        x = self.tower.features(pixel_values, self.cfg.vision.num_layers)  # [B, side * side, vision hidden]
        b, _, h = x.shape
        grid = x.transpose(1, 2).reshape(b, h, self.side, self.side)
        x = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        # Gemma3RMSNorm: in fp32, x * (1 + w), back to the input's dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.vision.layer_norm_eps) * (1.0 + self.norm)
        return torch.matmul(xf.to(x.dtype), self.proj)
