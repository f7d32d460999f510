"""A ViT vision tower (CLIP's, as LLaVA-1.5 uses it; SigLIP differs in the flags here) over HF-named weights: patch
embedding (a stride-`patch` convolution), a class token and learned positions (CLIP), a pre-norm (CLIP), then
pre-norm encoder layers of bidirectional attention and an MLP. `features(pixel_values, layer)` returns the hidden
states after encoder layer `layer` (Python indexing over 0..num_layers, 0 = the embeddings, as transformers'
`hidden_states[layer]`), running no layer past it. Each image is its own batch entry: an image's features do not
depend on the others in the call."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,  # Qwen2.5-VL's gated vision MLP
}


# SigLIP's tower as Idefics3 (SmolVLM) runs it: its last hidden states through post_layernorm
NORMED_OUTPUT = ("idefics3_vision", "smolvlm_vision")
VISION_MODEL_TYPES = ("clip_vision_model", "siglip_vision_model", *NORMED_OUTPUT)


@dataclass(frozen=True, slots=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    class_token: bool = True  # CLIP prepends a class embedding; SigLIP does not
    pre_norm: bool = True  # CLIP's pre_layrnorm after the embeddings
    post_norm: bool = False  # the encoder's last hidden states normed (Idefics3's tower; CLIP's norms only its pooled output)
    pooling_head: bool = False  # SigLIP's attention-pooling head is in the checkpoint (never run: dropped at build)

    @classmethod
    def from_hf(cls, d: dict, source: str) -> VisionConfig:
        """A vision_config from config.json (CLIP's `clip_vision_model` fields)."""
        kind = d.get("model_type", "clip_vision_model")
        if kind not in VISION_MODEL_TYPES:
            raise ValueError(f"{source}: vision_config.model_type {kind!r} is not supported ({', '.join(VISION_MODEL_TYPES)})")
        act = d.get("hidden_act", "quick_gelu" if kind == "clip_vision_model" else "gelu_pytorch_tanh")
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"], patch_size=d["patch_size"],
                   image_size=d["image_size"], num_channels=d.get("num_channels", 3),
                   layer_norm_eps=d.get("layer_norm_eps", 1e-5 if kind == "clip_vision_model" else 1e-6),
                   hidden_act=act, class_token=kind == "clip_vision_model", pre_norm=kind == "clip_vision_model",
                   post_norm=kind in NORMED_OUTPUT)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def weight_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """Every HF weight name (under `prefix`, e.g. "model.vision_tower.vision_model.") and its shape."""
        h, i, p = self.hidden_size, self.intermediate_size, self.patch_size
        out = {f"{prefix}embeddings.patch_embedding.weight": (h, self.num_channels, p, p),
               f"{prefix}embeddings.position_embedding.weight": (self.num_patches + self.class_token, h)}
        if self.class_token:
            out[f"{prefix}embeddings.class_embedding"] = (h,)
        else:
            out[f"{prefix}embeddings.patch_embedding.bias"] = (h,)
        if self.pre_norm:
            out.update({f"{prefix}pre_layrnorm.weight": (h,), f"{prefix}pre_layrnorm.bias": (h,)})
        if self.class_token or self.post_norm:  # CLIP's norm of the pooled output: unused by LLaVA (dropped at build)
            out.update({f"{prefix}post_layernorm.weight": (h,), f"{prefix}post_layernorm.bias": (h,)})
        for n in range(self.num_layers):
            lp = f"{prefix}encoder.layers.{n}."
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                out[f"{lp}self_attn.{proj}.weight"], out[f"{lp}self_attn.{proj}.bias"] = (h, h), (h,)
            for norm in ("layer_norm1", "layer_norm2"):
                out[f"{lp}{norm}.weight"], out[f"{lp}{norm}.bias"] = (h,), (h,)
            out[f"{lp}mlp.fc1.weight"], out[f"{lp}mlp.fc1.bias"] = (i, h), (i,)
            out[f"{lp}mlp.fc2.weight"], out[f"{lp}mlp.fc2.bias"] = (h, i), (h,)
        if self.pooling_head:  # SiglipMultiheadAttentionPoolingHead's
            hp = f"{prefix}head."
            out.update({f"{hp}probe": (1, 1, h), f"{hp}attention.in_proj_weight": (3 * h, h),
                        f"{hp}attention.in_proj_bias": (3 * h,), f"{hp}attention.out_proj.weight": (h, h),
                        f"{hp}attention.out_proj.bias": (h,), f"{hp}layernorm.weight": (h,), f"{hp}layernorm.bias": (h,),
                        f"{hp}mlp.fc1.weight": (i, h), f"{hp}mlp.fc1.bias": (i,), f"{hp}mlp.fc2.weight": (h, i),
                        f"{hp}mlp.fc2.bias": (h,)})
        return out


@dataclass(slots=True)
class VisionLayer:
    qkv: torch.Tensor  # [3h, h]: q, k, v fused
    qkv_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor
    norm1: tuple[torch.Tensor, torch.Tensor]
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: tuple[torch.Tensor, torch.Tensor]
    fc2: tuple[torch.Tensor, torch.Tensor]

    def __call__(self, x: torch.Tensor, cfg: VisionConfig) -> torch.Tensor:
        b, t, h = x.shape
        heads, d = cfg.num_heads, h // cfg.num_heads
        y = F.layer_norm(x, (h,), *self.norm1, cfg.layer_norm_eps)
        q, k, v = F.linear(y, self.qkv, self.qkv_bias).view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4)
        # every patch sees every patch of its image; torch's fused attention (a flash kernel on the CPU: no
        # [heads, T, T] score matrix in fp32, 4x faster than the matmul-softmax-matmul at SigLIP's 1024 patches)
        attn = F.scaled_dot_product_attention(q, k, v)
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, h), self.out, self.out_bias)
        y = F.layer_norm(x, (h,), *self.norm2, cfg.layer_norm_eps)
        return x + F.linear(ACTIVATIONS[cfg.hidden_act](F.linear(y, *self.fc1)), *self.fc2)


class VisionTower:
    def __init__(self, cfg: VisionConfig, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes its weights out of `w` (HF names under `prefix`), in `dtype` on `device`."""
        self.cfg = cfg

        def take(name: str) -> torch.Tensor:
            return w.pop(prefix + name).to(device=device, dtype=dtype)

        self.patch = take("embeddings.patch_embedding.weight")
        self.patch_bias = None if cfg.class_token else take("embeddings.patch_embedding.bias")
        self.positions = take("embeddings.position_embedding.weight")
        self.class_embedding = take("embeddings.class_embedding") if cfg.class_token else None
        self.pre_norm = (take("pre_layrnorm.weight"), take("pre_layrnorm.bias")) if cfg.pre_norm else None
        self.layers = []
        for n in range(cfg.num_layers):
            lp = f"encoder.layers.{n}."
            qkv = torch.cat([take(f"{lp}self_attn.{p}.weight") for p in ("q_proj", "k_proj", "v_proj")])
            qkv_bias = torch.cat([take(f"{lp}self_attn.{p}.bias") for p in ("q_proj", "k_proj", "v_proj")])
            self.layers.append(VisionLayer(
                qkv, qkv_bias, take(f"{lp}self_attn.out_proj.weight"), take(f"{lp}self_attn.out_proj.bias"),
                (take(f"{lp}layer_norm1.weight"), take(f"{lp}layer_norm1.bias")),
                (take(f"{lp}layer_norm2.weight"), take(f"{lp}layer_norm2.bias")),
                (take(f"{lp}mlp.fc1.weight"), take(f"{lp}mlp.fc1.bias")),
                (take(f"{lp}mlp.fc2.weight"), take(f"{lp}mlp.fc2.bias"))))
        self.post_norm = (take("post_layernorm.weight"), take("post_layernorm.bias")) if cfg.post_norm else None
        for name in [k for k in w if k.startswith(prefix + "post_layernorm.") or k.startswith(prefix + "head.")]:
            del w[name]  # the pooled output's norm and head: LLaVA reads hidden states, never the pooled output
        self.dtype = dtype

    def features(self, pixel_values: torch.Tensor, layer: int, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, C, H, W] pixel values -> [B, tokens, hidden] hidden states after encoder layer `layer` (the last
        layer's through the post-norm where the tower has one). `position_ids`: the position table's row of each
        patch (a tower that takes other sizes than its own, as Idefics3's); None: the table in order."""
        cfg = self.cfg
        depth = layer % (cfg.num_layers + 1)
        x = F.conv2d(pixel_values.to(self.dtype), self.patch, self.patch_bias, stride=cfg.patch_size)
        x = x.flatten(2).transpose(1, 2)  # [B, patches, hidden], row-major over the patch grid
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        n = x.shape[1]
        if position_ids is not None:
            x = x + self.positions[position_ids]
        elif n != self.positions.shape[0]:
            side = math.isqrt(n - (self.class_embedding is not None))
            raise ValueError(f"pixel values of {side * cfg.patch_size} px; this vision tower takes {cfg.image_size} px")
        else:
            x = x + self.positions
        if self.pre_norm is not None:
            x = F.layer_norm(x, (cfg.hidden_size,), *self.pre_norm, cfg.layer_norm_eps)
        for lay in self.layers[:depth]:
            x = lay(x, cfg)
        if self.post_norm is not None and depth == cfg.num_layers:
            x = F.layer_norm(x, (cfg.hidden_size,), *self.post_norm, cfg.layer_norm_eps)
        return x
