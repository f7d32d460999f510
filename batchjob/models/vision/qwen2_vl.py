"""Qwen2-VL's image encoder: the processor's flattened patches (batchjob/images/qwen2_vl.py: each row a
temporal_patch_size x patch x patch cube of the image, grouped by 2 x 2 merge blocks) through a linear patch embedding
(the Conv3d written as a matmul), vision blocks with 2-D rotary positions (each patch's row and column) and
bidirectional attention over the image, then the patch merger: a LayerNorm, each merge block's 4 patches
concatenated, and a two-layer GELU MLP into the language model's hidden size. One image in (its patches, shaped
[grid_t, grid_h, grid_w, patch dims] so its grid travels with it), one row per `<|image_pad|>` placeholder out."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.models.vision.vit import ACTIVATIONS

VISUAL = "visual."  # where the encoder takes its weights from (the Hub's names; the family maps transformers 5's)


@dataclass(frozen=True, slots=True)
class Qwen2VLVisionConfig:
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    hidden_act: str
    text_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, d: dict, text_hidden_size: int, source: str) -> Qwen2VLVisionConfig:
        act = d.get("hidden_act", "quick_gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
        return cls(depth=d.get("depth", 32), embed_dim=d.get("embed_dim", 1280), num_heads=d.get("num_heads", 16),
                   mlp_ratio=d.get("mlp_ratio", 4), hidden_act=act, text_hidden_size=d.get("hidden_size", text_hidden_size),
                   patch_size=d.get("patch_size", 14), temporal_patch_size=d.get("temporal_patch_size", 2),
                   merge_size=d.get("spatial_merge_size", 2), in_channels=d.get("in_channels", 3), rope_theta=float(theta))

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        e, m, p = self.embed_dim, int(self.embed_dim * self.mlp_ratio), self.patch_size
        merged = e * self.merge_size ** 2
        out = {f"{VISUAL}patch_embed.proj.weight": (e, self.in_channels, self.temporal_patch_size, p, p),
               f"{VISUAL}merger.ln_q.weight": (e,), f"{VISUAL}merger.ln_q.bias": (e,),
               f"{VISUAL}merger.mlp.0.weight": (merged, merged), f"{VISUAL}merger.mlp.0.bias": (merged,),
               f"{VISUAL}merger.mlp.2.weight": (self.text_hidden_size, merged),
               f"{VISUAL}merger.mlp.2.bias": (self.text_hidden_size,)}
        for n in range(self.depth):
            b = f"{VISUAL}blocks.{n}."
            out.update({f"{b}norm1.weight": (e,), f"{b}norm1.bias": (e,), f"{b}norm2.weight": (e,), f"{b}norm2.bias": (e,),
                        f"{b}attn.qkv.weight": (3 * e, e), f"{b}attn.qkv.bias": (3 * e,),
                        f"{b}attn.proj.weight": (e, e), f"{b}attn.proj.bias": (e,),
                        f"{b}mlp.fc1.weight": (m, e), f"{b}mlp.fc1.bias": (m,), f"{b}mlp.fc2.weight": (e, m),
                        f"{b}mlp.fc2.bias": (e,)})
        return out


def patch_positions(grid_h: int, grid_w: int, merge: int) -> torch.Tensor:
    """Each patch's (row, column), [h * w, 2], in the processor's order: merge blocks row-major, row-major within."""
    rows = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
    cols = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
    block = (grid_h // merge, merge, grid_w // merge, merge)
    return torch.stack([rows.reshape(block).transpose(1, 2).flatten(), cols.reshape(block).transpose(1, 2).flatten()], -1)


class Qwen2VLImageEncoder:
    def __init__(self, cfg: Qwen2VLVisionConfig, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes the encoder's weights (under VISUAL) out of `w`."""
        self.cfg, self.dtype = cfg, dtype

        def take(name: str) -> torch.Tensor:
            return w.pop(VISUAL + name).to(device=device, dtype=dtype)

        self.patch = take("patch_embed.proj.weight").reshape(cfg.embed_dim, cfg.patch_dim)
        self.blocks = [{k: take(f"blocks.{n}.{k}") for k in (
            "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "attn.qkv.weight", "attn.qkv.bias",
            "attn.proj.weight", "attn.proj.bias", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias")}
            for n in range(cfg.depth)]
        self.merger = {k: take(f"merger.{k}") for k in ("ln_q.weight", "ln_q.bias", "mlp.0.weight", "mlp.0.bias",
                                                         "mlp.2.weight", "mlp.2.bias")}
        half = cfg.embed_dim // cfg.num_heads // 2  # each of row and column rotates half a head
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[1, grid_t, grid_h, grid_w, patch dims] -> [1, grid_t * grid_h * grid_w / merge^2, text hidden]."""
        cfg = self.cfg
        _, t, gh, gw, _ = pixel_values.shape
        x = F.linear(pixel_values.reshape(-1, cfg.patch_dim).to(self.dtype), self.patch)  # [N, embed]
        pos = patch_positions(gh, gw, cfg.merge_size).repeat(t, 1)  # [N, 2]
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head/2]: the rows' then the columns'
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # fp32 [N, 1, head]
        heads, e = cfg.num_heads, cfg.embed_dim
        for b in self.blocks:
            y = F.layer_norm(x, (e,), b["norm1.weight"], b["norm1.bias"], 1e-6)
            q, k, v = F.linear(y, b["attn.qkv.weight"], b["attn.qkv.bias"]).view(-1, 3, heads, e // heads).unbind(1)
            q, k = (_rotate(z, cos, sin) for z in (q, k))  # in fp32, as transformers does
            attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            x = x + F.linear(attn[0].transpose(0, 1).reshape(-1, e), b["attn.proj.weight"], b["attn.proj.bias"])
            y = F.layer_norm(x, (e,), b["norm2.weight"], b["norm2.bias"], 1e-6)
            h = ACTIVATIONS[cfg.hidden_act](F.linear(y, b["mlp.fc1.weight"], b["mlp.fc1.bias"]))
            x = x + F.linear(h, b["mlp.fc2.weight"], b["mlp.fc2.bias"])
        m = self.merger
        y = F.layer_norm(x, (e,), m["ln_q.weight"], m["ln_q.bias"], 1e-6).view(-1, e * cfg.merge_size ** 2)
        y = F.linear(F.gelu(F.linear(y, m["mlp.0.weight"], m["mlp.0.bias"])), m["mlp.2.weight"], m["mlp.2.bias"])
        return y[None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
