"""Pixel values and image grids for Qwen2-VL / Qwen2.5-VL vision towers (both use the same image processor), as
transformers' Qwen2VLImageProcessorPil computes them, value for value: transparency composited onto white, RGB; one
Pillow resize to smart_resize's size, both sides multiples of patch_size * merge_size (28) with the pixel count
kept within [min_pixels, max_pixels]; rescale in float64 then float32, normalise per channel in float32; then cut
into patch_size x patch_size patches, flattened one row per patch.

Surprises in transformers' behaviour, all reproduced here:
- smart_resize first rounds each side to the nearest multiple of 28 with Python's round(), which rounds halves to
  even (70 px -> 2.5 -> 56, 42 px -> 1.5 -> 56). Only if that area is above max_pixels (or below min_pixels) does it
  rescale both sides by sqrt(area ratio), flooring (or ceiling) to multiples of 28 (at least 28 when flooring). The
  result is not checked again: rounding can leave it outside [min_pixels, max_pixels] (a 20x20 image with min_pixels
  56*56 becomes 56x56 = 3136; a very long thin image can exceed max_pixels). Aspect ratios over 200 are refused.
  Even an image already at the target size goes through Pillow's resize (a copy, so the values are unchanged).
- Rows are not in raster order: they go merge window by merge window (grid_h/m, grid_w/m, then the m x m patches
  inside the window, row-major), so the model can merge each 2x2 window into one token. Within a row the values are
  (channel, temporal, y, x): the still image is repeated temporal_patch_size (2) times as if it were two video
  frames, so each row holds every channel's patch twice. grid_t is always 1 for an image.
- Top-level "min_pixels"/"max_pixels" (older configs, real Qwen2-VL/2.5-VL checkpoints) override the newer
  "size": {"shortest_edge": min, "longest_edge": max} when both are present; a null one falls back to `size`.
  Both pixel counts must end up set, else transformers refuses the image ("size" only holding the old
  {"min_pixels", "max_pixels"} keys counts as unset). The class default is 56*56 .. 28*28*1280, but the real
  checkpoints' configs say max_pixels 12845056.
- A missing field takes the default but an explicit null does not (the value is stored on the processor as is): a
  null flag is false, a null size falls back to the default; a null resample, rescale_factor, mean/std or patch
  setting makes transformers refuse the image, so we refuse the config.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from batchjob.images.clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, per_channel, rescale_normalize, to_rgb

MIN_PIXELS = 56 * 56  # transformers' Qwen2VLImageProcessor defaults
MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


@dataclass(frozen=True, slots=True)
class Qwen2VLPreprocessor:
    min_pixels: int = MIN_PIXELS  # "min_pixels", or "size": {"shortest_edge": ...}
    max_pixels: int = MAX_PIXELS  # "max_pixels", or "size": {"longest_edge": ...}
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = Image.Resampling.BICUBIC
    rescale_factor: float | None = 1 / 255  # None: do_rescale false
    mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN  # None: do_normalize false
    std: tuple[float, ...] | None = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, cfg: dict) -> Qwen2VLPreprocessor:
        """preprocessor_config.json's fields (Qwen2VLImageProcessor's names and defaults; nulls as transformers
        treats them, see the module docstring). Raises ValueError, naming the field, for settings that change the
        pixels in a way we do not reproduce or that transformers refuses. Fields the Qwen2-VL image processor
        ignores (do_center_crop, crop_size, do_pad, ...) are ignored here too."""
        if not cfg.get("do_convert_rgb", True):
            raise ValueError("do_convert_rgb: false/null is not supported (we always convert to RGB)")
        if not cfg.get("do_resize", True):
            raise ValueError("do_resize: false/null is not supported (transformers then only takes images whose "
                             "sides are multiples of patch_size * merge_size)")
        size = cfg.get("size")
        size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS} if size is None else size
        if not isinstance(size, dict):
            raise ValueError(f"size: must be {{'shortest_edge': min, 'longest_edge': max}}, got {size!r}")
        lo = cfg["min_pixels"] if cfg.get("min_pixels") is not None else size.get("shortest_edge")
        hi = cfg["max_pixels"] if cfg.get("max_pixels") is not None else size.get("longest_edge")
        if not lo or not hi:
            raise ValueError(f"size: min/max pixels unset (min_pixels {lo!r}, max_pixels {hi!r}, size {size!r})")
        ints = {}
        for field, default in (("patch_size", 14), ("temporal_patch_size", 2), ("merge_size", 2)):
            ints[field] = cfg.get(field, default)
            if not isinstance(ints[field], int) or ints[field] < 1:
                raise ValueError(f"{field}: must be a positive integer, got {ints[field]!r}")
        resample = cfg.get("resample", Image.Resampling.BICUBIC)
        if resample is None:
            raise ValueError("resample: null (transformers refuses to resize without one)")
        rescale, normalize = bool(cfg.get("do_rescale", True)), bool(cfg.get("do_normalize", True))
        factor = cfg.get("rescale_factor", 1 / 255)
        if rescale and factor is None:
            raise ValueError("rescale_factor: null with do_rescale")
        mean = per_channel(cfg.get("image_mean", OPENAI_CLIP_MEAN))
        std = per_channel(cfg.get("image_std", OPENAI_CLIP_STD))
        if normalize and (len(mean) != 3 or len(std) != 3):
            raise ValueError(f"image_mean/image_std: need 3 values (or one) for RGB, got {mean!r} / {std!r}")
        return cls(
            min_pixels=int(lo), max_pixels=int(hi), **ints,
            resample=int(resample),
            rescale_factor=float(factor) if rescale else None,
            mean=mean if normalize else None,
            std=std if normalize else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Qwen2VLPreprocessor:
        return cls.from_config(json.loads((Path(folder) / "preprocessor_config.json").read_text()))

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) the image is resized to (transformers' smart_resize)."""
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def patches(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(float32 [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2] flattened patches in
        transformers' order, (grid_t, grid_h, grid_w)) -- exactly the rows of transformers' pixel_values for this
        one image and its image_grid_thw row."""
        img = to_rgb(image)
        h, w = self.resized_size(img.height, img.width)
        x = self._pixels(np.array(img.resize((w, h), resample=self.resample)))  # [3, h, w] float32
        c, p, m, t = x.shape[0], self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
        x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t,) + x.shape[5:])  # the frame, t times
        return np.ascontiguousarray(x.reshape(gh * gw, c * t * p * p)), (1, gh, gw)

    def num_placeholders(self, grid: tuple[int, int, int]) -> int:
        """<|image_pad|> tokens the processor writes for an image of this grid: t * h * w // merge_size**2."""
        t, h, w = grid
        return t * h * w // self.merge_size ** 2

    def _pixels(self, rgb: np.ndarray) -> np.ndarray:
        return rescale_normalize(rgb, self.rescale_factor, self.mean, self.std)



def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """transformers' smart_resize, with its float arithmetic in the same order: round (halves to even) to multiples
    of factor; if the area is then over max_pixels, scale down and floor; if under min_pixels, scale up and ceil."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(height, width) / min(height, width)}")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
