"""Qwen2-VL's and Qwen2.5-VL's image encoder: the processor's flattened patches (batchjob/images/qwen2_vl.py: each row a
temporal_patch_size x patch x patch cube of the image, grouped by 2 x 2 merge blocks) through a linear patch embedding
(the Conv3d written as a matmul), vision blocks with 2-D rotary positions (each patch's row and column) and
bidirectional attention over the image (Qwen2.5-VL: within windows, but for its full-attention blocks; RMSNorms and a
gated MLP), then the patch merger: a LayerNorm, each merge block's 4 patches
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
    intermediate_size: int
    hidden_act: str
    text_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    # Qwen2.5-VL's tower: RMSNorms, a gated MLP, and attention within windows of `window_size` px except in the
    # full-attention blocks; Qwen2-VL's: LayerNorms, fc1/fc2, full attention everywhere
    v2_5: bool = False
    window_size: int = 112
    full_attention_blocks: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, d: dict, text_hidden_size: int, source: str) -> Qwen2VLVisionConfig:
        v2_5 = d.get("model_type") == "qwen2_5_vl_vision" or "out_hidden_size" in d
        act = d.get("hidden_act", "silu" if v2_5 else "quick_gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"{source}: vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
        common = dict(depth=d.get("depth", 32), num_heads=d.get("num_heads", 16), hidden_act=act,
                      patch_size=d.get("patch_size", 14), temporal_patch_size=d.get("temporal_patch_size", 2),
                      merge_size=d.get("spatial_merge_size", 2), in_channels=d.get("in_channels", 3), rope_theta=float(theta))
        if v2_5:
            return cls(embed_dim=d.get("hidden_size", 1280), intermediate_size=d.get("intermediate_size", 3420),
                       text_hidden_size=d.get("out_hidden_size", text_hidden_size), v2_5=True,
                       window_size=d.get("window_size", 112),
                       full_attention_blocks=tuple(d.get("fullatt_block_indexes", (7, 15, 23, 31))), **common)
        embed = d.get("embed_dim", 1280)
        return cls(embed_dim=embed, intermediate_size=int(embed * d.get("mlp_ratio", 4)),
                   text_hidden_size=d.get("hidden_size", text_hidden_size), **common)

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        e, m, p = self.embed_dim, self.intermediate_size, self.patch_size
        merged = e * self.merge_size ** 2
        out = {f"{VISUAL}patch_embed.proj.weight": (e, self.in_channels, self.temporal_patch_size, p, p),
               f"{VISUAL}merger.ln_q.weight": (e,),
               f"{VISUAL}merger.mlp.0.weight": (merged, merged), f"{VISUAL}merger.mlp.0.bias": (merged,),
               f"{VISUAL}merger.mlp.2.weight": (self.text_hidden_size, merged),
               f"{VISUAL}merger.mlp.2.bias": (self.text_hidden_size,)}
        if not self.v2_5:
            out[f"{VISUAL}merger.ln_q.bias"] = (e,)
        for n in range(self.depth):
            b = f"{VISUAL}blocks.{n}."
            out.update({f"{b}norm1.weight": (e,), f"{b}norm2.weight": (e,),
                        f"{b}attn.qkv.weight": (3 * e, e), f"{b}attn.qkv.bias": (3 * e,),
                        f"{b}attn.proj.weight": (e, e), f"{b}attn.proj.bias": (e,)})
            if self.v2_5:
                for proj, shape in (("gate_proj", (m, e)), ("up_proj", (m, e)), ("down_proj", (e, m))):
                    out[f"{b}mlp.{proj}.weight"], out[f"{b}mlp.{proj}.bias"] = shape, shape[:1]
            else:
                out.update({f"{b}norm1.bias": (e,), f"{b}norm2.bias": (e,), f"{b}mlp.fc1.weight": (m, e),
                            f"{b}mlp.fc1.bias": (m,), f"{b}mlp.fc2.weight": (e, m), f"{b}mlp.fc2.bias": (e,)})
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
        self.patch = w.pop(VISUAL + "patch_embed.proj.weight").to(device=device, dtype=dtype).reshape(cfg.embed_dim,
                                                                                                      cfg.patch_dim)
        names = [k for k in cfg.weight_shapes() if k.startswith(VISUAL) and "patch_embed" not in k]
        self.w = {k.removeprefix(VISUAL): w.pop(k).to(device=device, dtype=dtype) for k in names}
        half = cfg.embed_dim // cfg.num_heads // 2  # each of row and column rotates half a head
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[1, grid_t, grid_h, grid_w, patch dims] -> [1, grid_t * grid_h * grid_w / merge^2, text hidden]."""
        cfg, w = self.cfg, self.w
        _, t, gh, gw, _ = pixel_values.shape
        x = F.linear(pixel_values.reshape(-1, cfg.patch_dim).to(self.dtype), self.patch)  # [N, embed]
        pos = patch_positions(gh, gw, cfg.merge_size).repeat(t, 1)  # [N, 2]
        unit = cfg.merge_size ** 2
        order, windows = window_order(t, gh, gw, cfg) if cfg.v2_5 else (None, None)
        if order is not None:  # Qwen2.5-VL: patches grouped window by window (merge blocks kept whole)
            x, pos = (z.view(-1, unit, z.shape[-1])[order].reshape(-1, z.shape[-1]) for z in (x, pos))
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [N, head/2]: the rows' then the columns'
        angles = torch.cat([freqs, freqs], dim=-1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]  # fp32 [N, 1, head]
        heads, e = cfg.num_heads, cfg.embed_dim
        for n in range(cfg.depth):
            b = f"blocks.{n}."
            y = self._norm(x, b + "norm1")
            q, k, v = F.linear(y, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"]).view(-1, 3, heads, e // heads).unbind(1)
            q, k = (_rotate(z, cos, sin) for z in (q, k))  # in fp32, as transformers does
            spans = windows if windows is not None and n not in cfg.full_attention_blocks else [len(x)]
            attn = torch.cat([_attend(q[s], k[s], v[s]) for s in _slices(spans)])
            x = x + F.linear(attn.reshape(-1, e), w[b + "attn.proj.weight"], w[b + "attn.proj.bias"])
            y = self._norm(x, b + "norm2")
            if cfg.v2_5:
                h = ACTIVATIONS[cfg.hidden_act](F.linear(y, w[b + "mlp.gate_proj.weight"], w[b + "mlp.gate_proj.bias"]))
                h = h * F.linear(y, w[b + "mlp.up_proj.weight"], w[b + "mlp.up_proj.bias"])
                x = x + F.linear(h, w[b + "mlp.down_proj.weight"], w[b + "mlp.down_proj.bias"])
            else:
                h = ACTIVATIONS[cfg.hidden_act](F.linear(y, w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"]))
                x = x + F.linear(h, w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"])
        y = self._norm(x, "merger.ln_q").view(-1, e * unit)
        y = F.linear(F.gelu(F.linear(y, w["merger.mlp.0.weight"], w["merger.mlp.0.bias"])), w["merger.mlp.2.weight"],
                     w["merger.mlp.2.bias"])
        if order is not None:
            y = y[torch.argsort(order)]  # back to the merge blocks' own order: the placeholders'
        return y[None]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        weight = self.w[name + ".weight"]
        if self.cfg.v2_5:  # RMSNorm in fp32, as transformers' Qwen2_5_VLRMSNorm
            xf = x.float()
            return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return F.layer_norm(x, (x.shape[-1],), weight, self.w[name + ".bias"], 1e-6)


def window_order(t: int, gh: int, gw: int, cfg: Qwen2VLVisionConfig) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merge blocks' order grouped window by window (row-major windows of `window_size`
    px, row-major blocks inside), and each window's patch count; as transformers' get_vision_window_index."""
    m, side = cfg.merge_size, cfg.window_size // cfg.merge_size // cfg.patch_size
    h, w = gh // m, gw // m
    index = torch.arange(t * h * w).reshape(t, h, w)
    ph, pw = side - h % side, side - w % side
    padded = F.pad(index, (0, pw, 0, ph), "constant", -100)
    nh, nw = (h + ph) // side, (w + pw) // side
    padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side, side)
    sizes = (padded != -100).sum([2, 3]).reshape(-1)
    flat = padded.reshape(-1)
    return flat[flat != -100], [int(n) * m * m for n in sizes if n]


def _slices(spans: list[int]):
    start = 0
    for n in spans:
        yield slice(start, start + n)
        start += n


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[n, heads, d] each -> [n, heads, d]: bidirectional, torch's fused attention."""
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None])[0].transpose(0, 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
