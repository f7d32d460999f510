"""Pixel values for CLIP-style vision towers (LLaVA's CLIP ViT-L/336, SigLIP's fixed-size processors), as
transformers' CLIPImageProcessor computes them with its PIL backend, value for value: transparency composited
onto white, RGB; the shortest edge resized to `size` with Pillow's filter (the long edge truncated, as
transformers rounds), a centre crop (zero-padded where the image is smaller), rescale in float64 then float32,
normalise per channel in float32. The settings come from the model folder's preprocessor_config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True)
class ClipPreprocessor:
    shortest_edge: int | None = 224  # resize the shortest edge to this (None: to `height` x `width`)
    height: int | None = None
    width: int | None = None
    crop: tuple[int, int] | None = (224, 224)  # (height, width) of the centre crop; None: no crop
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN
    std: tuple[float, ...] | None = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, cfg: dict) -> ClipPreprocessor:
        """preprocessor_config.json's fields (CLIPImageProcessor's names and defaults)."""
        size = cfg.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        crop = cfg.get("crop_size", {"height": 224, "width": 224})
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        return cls(
            shortest_edge=size.get("shortest_edge") if cfg.get("do_resize", True) else None,
            height=size.get("height"), width=size.get("width"),
            crop=(crop["height"], crop["width"]) if cfg.get("do_center_crop", True) else None,
            resample=int(cfg.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=cfg.get("rescale_factor", 1 / 255) if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg.get("image_mean", OPENAI_CLIP_MEAN)) if cfg.get("do_normalize", True) else None,
            std=tuple(cfg.get("image_std", OPENAI_CLIP_STD)) if cfg.get("do_normalize", True) else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> ClipPreprocessor:
        return cls.from_config(json.loads((Path(folder) / "preprocessor_config.json").read_text()))

    def pixel_values(self, image: Image.Image) -> np.ndarray:
        """float32 [3, H, W]."""
        rgb = np.array(to_rgb(image))  # [H, W, 3] uint8
        if self.shortest_edge is not None or (self.height and self.width):
            h, w = rgb.shape[:2]
            if self.shortest_edge is not None:
                short, long = (w, h) if w <= h else (h, w)
                new_long = int(self.shortest_edge * long / short)
                nh, nw = (new_long, self.shortest_edge) if w <= h else (self.shortest_edge, new_long)
            else:
                nh, nw = self.height, self.width
            rgb = np.array(Image.fromarray(rgb).resize((nw, nh), resample=self.resample))
        x = np.moveaxis(rgb, -1, 0)  # [3, H, W]
        if self.crop is not None:
            x = center_crop(x, *self.crop)
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.mean is not None:
            if not np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
            mean, std = np.array(self.mean, dtype=x.dtype), np.array(self.std, dtype=x.dtype)
            x = ((x.T - mean) / std).T
        return np.ascontiguousarray(x)


def rescale_normalize(rgb: np.ndarray, rescale_factor: float | None, mean: tuple[float, ...] | None,
                      std: tuple[float, ...] | None) -> np.ndarray:
    """[H, W, 3] uint8 -> float32 [3, H, W], rescaled (in float64, then float32) and normalised per channel (in
    float32) as transformers' PIL backend does; the Idefics3 and Qwen2-VL preprocessors' last step."""
    x = np.moveaxis(rgb, -1, 0)
    if rescale_factor is not None:
        x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
    if mean is not None:
        x = x.astype(np.float32)  # a no-op after rescaling; uint8 -> float32 otherwise, as transformers does
        x = ((x.T - np.array(mean, dtype=np.float32)) / np.array(std, dtype=np.float32)).T
    return np.ascontiguousarray(x, dtype=np.float32)


def per_channel(value: float | list[float] | None) -> tuple[float, ...]:
    """A per-channel mean or std as a tuple: one number for every channel (transformers' rule), null as ()."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(x: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """[C, H, W] -> [C, ch, cw] around the centre, zero-padded where the image is smaller (transformers' rounding)."""
    h, w = x.shape[-2:]
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0:
        return x[..., top:top + ch, left:left + cw]
    nh, nw = max(ch, h), max(cw, w)
    padded = np.zeros(x.shape[:-2] + (nh, nw), dtype=x.dtype)
    tp, lp = -(-(nh - h) // 2), -(-(nw - w) // 2)
    padded[..., tp:tp + h, lp:lp + w] = x
    top, left = top + tp, left + lp
    return padded[..., max(0, top):min(nh, top + ch), max(0, left):min(nw, left + cw)]
