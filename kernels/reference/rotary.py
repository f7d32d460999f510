"""Rotary position embedding (HF "rotate_half" layout), with Llama 3 frequency scaling and Phi-3's longrope."""
from __future__ import annotations

import math

import torch


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables indexed by absolute position (no per-step recomputation)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        """`scaling`: HF's rope_scaling dict (llama3, linear or longrope). Longrope has a table for its short factors
        and one for its long ones; `use_long` chooses (models/config.py LongRope says when)."""
        shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.long: tuple[torch.Tensor, torch.Tensor] | None = None
        if (scaling or {}).get("rope_type") == "longrope":  # transformers' _compute_longrope_parameters
            short, long = (_table(1.0 / (torch.tensor(scaling[f"{part}_factor"], dtype=torch.float32) * theta ** shape),
                                  max_positions, scaling["attention_factor"], dtype) for part in ("short", "long"))
            (self.cos, self.sin), self.short, self.long = short, short, long
            return
        inv_freq = 1.0 / (theta ** shape)
        if (scaling or {}).get("rope_type", (scaling or {}).get("type")) == "linear":  # positions / factor (Gemma 3)
            inv_freq = inv_freq / scaling["factor"]
        elif scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.cos, self.sin = _table(inv_freq, max_positions, 1.0, dtype)

    def to(self, device: torch.device) -> None:
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        if self.long is not None:
            self.short, self.long = (tuple(t.to(device) for t in pair) for pair in (self.short, self.long))
            self.cos, self.sin = self.short

    def use_long(self, long: bool) -> None:
        """Longrope: rotate with the long factors (True) or the short ones."""
        self.cos, self.sin = self.long if long else self.short

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin rows for `positions`, [T, 1, D]: looked up once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def _table(inv_freq: torch.Tensor, max_positions: int, scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [T, H, D], k: [T, Hkv, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StepRotary:
    """A step's own rotary rows, indexed by the token's place in the step (M-RoPE: each token's row composed from
    its temporal, height and width positions). Takes a RotaryEmbedding's place for the kernels: `cos`, `sin`,
    `table`."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def mrope_rows(rope: RotaryEmbedding, positions: torch.Tensor, sections: tuple[int, ...]) -> StepRotary:
    """Qwen2-VL's M-RoPE: [3, T] (temporal, height, width) positions -> each token's cos/sin row, the rotary
    frequencies split into `sections` (of half the rotated dims) taking their angle from the temporal, height and
    width position in turn, as transformers' recomposition does."""
    half = rope.cos.shape[-1] // 2
    axis = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(sections)])
    if axis.numel() != half:
        raise ValueError(f"mrope_section {list(sections)} covers {axis.numel()} of the {half} rotary frequencies")
    axis = torch.cat([axis, axis]).to(positions.device)[None, None, :].expand(1, positions.shape[1], -1)
    return StepRotary(rope.cos[positions].gather(0, axis)[0], rope.sin[positions].gather(0, axis)[0])
