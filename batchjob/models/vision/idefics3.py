"""Idefics3's image encoder (SmolVLM's): a SigLIP vision tower run on one tile of an image (the processor splits an
image into square tiles plus a downscaled global image: batchjob/images/idefics3.py), its last hidden states normed,
then the connector: a pixel shuffle that folds each `scale_factor` x `scale_factor` block of patches into one row,
and a linear projection into the language model's hidden size. One tile in, `image_seq_len` rows out: one per
`<image>` placeholder of that tile in the prompt."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from batchjob.models.vision.vit import VisionConfig, VisionTower

# where the encoder takes its weights from (the Hub's names without the `model.` prefix; the family maps
# transformers' in-memory and saved layouts to these: models/families/idefics3.py canonical_name)
TOWER, CONNECTOR = "vision_model.", "connector.modality_projection.proj.weight"


@dataclass(frozen=True, slots=True)
class Idefics3VisionConfig:
    vision: VisionConfig
    text_hidden_size: int
    scale_factor: int = 2
    image_token_id: int = 128257

    @classmethod
    def from_hf(cls, d: dict, source: str) -> Idefics3VisionConfig:
        vision = dict(d.get("vision_config") or {})
        vision.setdefault("model_type", "idefics3_vision")
        for name, default in (("image_size", 224), ("patch_size", 32), ("hidden_size", 1152),
                              ("intermediate_size", 3072), ("num_hidden_layers", 12), ("num_attention_heads", 16)):
            vision.setdefault(name, default)  # Idefics3VisionConfig's defaults
        cfg = cls(VisionConfig.from_hf(vision, source), d["text_config"]["hidden_size"], d.get("scale_factor", 2),
                  d.get("image_token_id", 128257))
        side = cfg.vision.image_size // cfg.vision.patch_size
        if side % cfg.scale_factor:
            raise ValueError(f"{source}: a {side} x {side} patch grid does not fold by scale_factor {cfg.scale_factor}")
        return cfg

    @property
    def image_seq_len(self) -> int:
        """Placeholders per tile (transformers' `image_seq_len`)."""
        return (self.vision.image_size // self.vision.patch_size) ** 2 // self.scale_factor ** 2

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        out = self.vision.weight_shapes(TOWER)
        out[CONNECTOR] = (self.text_hidden_size, self.vision.hidden_size * self.scale_factor ** 2)
        return out


def position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """The position table's row for each patch of a `rows` x `cols` grid on a tower of `side` x `side` positions,
    bucketed as transformers' Idefics3VisionEmbeddings does (float32 fractions; equal to the table in order when the
    grid is the tower's own)."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    h = torch.bucketize(torch.clamp(torch.arange(rows, dtype=torch.float32) * (1.0 / torch.tensor(float(rows))),
                                    max=1.0 - 1e-6), boundaries, right=True)
    w = torch.bucketize(torch.clamp(torch.arange(cols, dtype=torch.float32) * (1.0 / torch.tensor(float(cols))),
                                    max=1.0 - 1e-6), boundaries, right=True)
    return (h[:, None] * side + w[None, :]).reshape(-1)


class Idefics3ImageEncoder:
    def __init__(self, cfg: Idefics3VisionConfig, w: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        """Takes the tower's and the connector's weights (under TOWER and CONNECTOR) out of `w`."""
        self.cfg = cfg
        self.tower = VisionTower(cfg.vision, w, TOWER, dtype, device)
        self.proj = w.pop(CONNECTOR).to(device=device, dtype=dtype)
        self._positions: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] tiles -> [B, image_seq_len, text hidden] (H and W: the tower's image size)."""
        v, p = self.cfg.vision, self.cfg.vision.patch_size
        grid = (pixel_values.shape[-2] // p, pixel_values.shape[-1] // p)
        if grid != (v.image_size // p,) * 2:
            raise ValueError(f"a tile of {pixel_values.shape[-2]} x {pixel_values.shape[-1]} px; this encoder takes "
                             f"{v.image_size} x {v.image_size} (the processor's max_image_size)")
        ids = self._positions.get(grid)
        if ids is None:
            ids = self._positions[grid] = position_ids(*grid, v.image_size // p).to(self.proj.device)
        x = self.tower.features(pixel_values, v.num_layers, position_ids=ids)
        return F.linear(pixel_shuffle(x, self.cfg.scale_factor), self.proj)


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[B, n*n, d] -> [B, n*n / s^2, d * s^2]: each s x s block of the patch grid folded into one row, in the order
    transformers' Idefics3Connector writes it."""
    b, seq, d = x.shape
    n = int(seq ** 0.5)
    x = x.view(b, n, n // s, d * s).permute(0, 2, 1, 3)
    x = x.reshape(b, n // s, n // s, d * s * s).permute(0, 2, 1, 3)
    return x.reshape(b, seq // (s * s), d * s * s)
