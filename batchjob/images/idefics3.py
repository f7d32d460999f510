"""Pixel values and prompt text for Idefics3 / SmolVLM vision towers, as transformers' Idefics3ImageProcessorPil and
Idefics3Processor compute them, value for value: transparency composited onto white, RGB; the longest edge resized
to `longest_edge` (small images are scaled *up* too; the other edge truncated, then bumped to even); when splitting,
both edges rounded up to multiples of `tile` (a second Pillow resize), cut into row-major tile x tile crops and
followed by the whole image resized to tile x tile (the "global" image); images that fit in one tile, and every image
when not splitting, become one tile x tile image. Rescale in float64 then float32, normalise per channel in float32.
Every image comes out tile x tile, so transformers' do_pad changes nothing for one image (it only adds all-zero
images when a sample holds several). The settings come from the model folder's preprocessor_config.json."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from batchjob.images.clip import per_channel, rescale_normalize, to_rgb

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on the resized image's longest edge
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True, slots=True)
class Idefics3Preprocessor:
    longest_edge: int | None = 4 * 364  # preprocessor_config "size": {"longest_edge": ...}; None: do_resize false
    tile: int = 364  # "max_image_size": {"longest_edge": ...}
    split: bool = True  # "do_image_splitting"
    resample: int = Image.Resampling.LANCZOS
    rescale_factor: float | None = 1 / 255  # None: do_rescale false
    mean: tuple[float, ...] | None = IMAGENET_STANDARD  # None: do_normalize false
    std: tuple[float, ...] | None = IMAGENET_STANDARD

    @classmethod
    def from_config(cls, cfg: dict) -> Idefics3Preprocessor:
        """preprocessor_config.json's fields (Idefics3ImageProcessor's names and defaults). As in transformers, a
        missing field takes the default but an explicit null does not: a null flag is false, a null resample is
        bilinear. Raises ValueError, naming the field, for settings that change the pixels in a way we do not
        reproduce (or that transformers refuses). Fields transformers' Idefics3 processor ignores (do_center_crop,
        crop_size, pad_size, do_pad for one image, video_sampling, ...) are ignored here too."""
        if not cfg.get("do_convert_rgb", True):
            raise ValueError("do_convert_rgb: false is not supported (we always convert to RGB)")
        size = cfg.get("size", {"longest_edge": 4 * 364})
        if not isinstance(size, dict) or not size.get("longest_edge"):
            raise ValueError(f"size: only {{'longest_edge': n}} is supported, got {size!r}")
        tile = cfg.get("max_image_size", {"longest_edge": 364})
        if not isinstance(tile, dict) or not tile.get("longest_edge"):
            raise ValueError(f"max_image_size: must be {{'longest_edge': n}}, got {tile!r}")
        rescale, normalize = bool(cfg.get("do_rescale", True)), bool(cfg.get("do_normalize", True))
        factor = cfg.get("rescale_factor", 1 / 255)
        if rescale and factor is None:
            raise ValueError("rescale_factor: null with do_rescale")
        mean = per_channel(cfg.get("image_mean", IMAGENET_STANDARD))
        std = per_channel(cfg.get("image_std", IMAGENET_STANDARD))
        if normalize and (len(mean) != 3 or len(std) != 3):
            raise ValueError(f"image_mean/image_std: need 3 values (or one) for RGB, got {mean!r} / {std!r}")
        resample = cfg.get("resample", Image.Resampling.LANCZOS)
        return cls(
            longest_edge=int(size["longest_edge"]) if cfg.get("do_resize", True) else None,
            tile=int(tile["longest_edge"]),
            split=bool(cfg.get("do_image_splitting", True)),
            resample=Image.Resampling.BILINEAR if resample is None else int(resample),
            rescale_factor=float(factor) if rescale else None,
            mean=mean if normalize else None,
            std=std if normalize else None,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> Idefics3Preprocessor:
        return cls.from_config(json.loads((Path(folder) / "preprocessor_config.json").read_text()))

    def tiles(self, image: Image.Image) -> tuple[list[np.ndarray], int, int]:
        """(tiles, rows, cols): float32 [3, H, W] arrays in transformers' order (the row-major tiles, then the
        global image; only the one image when it is not split, rows = cols = 0)."""
        img, m = to_rgb(image), self.tile
        if self.longest_edge is not None:
            img = self._resize(img, *_fit_longest_edge(img.height, img.width, self.longest_edge))
        if not self.split:
            return [self._pixels(np.array(self._resize(img, m, m)))], 0, 0
        img = self._resize(img, *_multiples_of(img.height, img.width, m))
        h, w = img.height, img.width
        if h <= m and w <= m:
            return [self._pixels(np.array(img))], 0, 0
        rows, cols = (h - m) // m + 1, (w - m) // m + 1
        full = np.array(img)  # [H, W, 3] uint8
        crops = [full[r * m:(r + 1) * m, c * m:(c + 1) * m] for r in range(rows) for c in range(cols)]
        crops.append(np.array(self._resize(img, m, m)))
        return [self._pixels(c) for c in crops], rows, cols

    def _resize(self, img: Image.Image, h: int, w: int) -> Image.Image:
        return img.resize((w, h), resample=self.resample)

    def _pixels(self, rgb: np.ndarray) -> np.ndarray:
        return rescale_normalize(rgb, self.rescale_factor, self.mean, self.std)



def _fit_longest_edge(height: int, width: int, max_len: int) -> tuple[int, int]:
    """The longest edge to max_len (up or down), the other truncated then made even; then under MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = max_len, int(max_len / aspect)
        height += height % 2
    else:
        height, width = max_len, int(max_len * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _multiples_of(height: int, width: int, m: int) -> tuple[int, int]:
    """Both edges rounded up to multiples of m (transformers' resize_for_vision_encoder, its float rounding too)."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / m) * m
        height = math.ceil(int(width / aspect) / m) * m
    else:
        height = math.ceil(height / m) * m
        width = math.ceil(int(height * aspect) / m) * m
    return height, width


def image_prompt(rows: int, cols: int, image_seq_len: int, *, fake_token: str = "<fake_token_around_image>",
                 image_token: str = "<image>", global_token: str = "<global-img>") -> str:
    """The text one image becomes in the prompt, as Idefics3Processor writes it (replace_image_token).

    Unsplit (rows = cols = 0): fake, global, image_seq_len image tokens, fake. Split: for each row, per tile fake,
    `<row_{r}_col_{c}>` (1-based), image_seq_len image tokens, then "\\n" ending the row; then "\\n" and the unsplit
    form for the global image -- so a blank line ("\\n\\n") separates the last row from the global image, and there is
    no newline after it. No BOS or anything else is added around it. image_seq_len is the processor's own
    (processor_config.json's "image_seq_len", 169 by default; SmolVLM-256M: 64): transformers' Idefics3Processor
    ignores the image_seq_len argument of its __call__ when writing this text."""
    one = fake_token + global_token + image_token * image_seq_len + fake_token
    if rows == 0 and cols == 0:
        return one
    text = "".join(
        "".join(f"{fake_token}<row_{r + 1}_col_{c + 1}>" + image_token * image_seq_len for c in range(cols)) + "\n"
        for r in range(rows))
    return text + "\n" + one
