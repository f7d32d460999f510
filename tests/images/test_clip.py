"""Our CLIP-style pixel values equal transformers' CLIPImageProcessor (its PIL backend) value for value: colour,
grey, palette and transparent images, portrait and landscape, smaller than the crop (padded) and larger."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from batchjob.images.clip import ClipPreprocessor

transformers = pytest.importorskip("transformers")


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (300, 500, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 256, (517, 301, 3), dtype=np.uint8))
    grey = Image.fromarray(rng.integers(0, 256, (64, 80), dtype=np.uint8))  # smaller than the crop: padded
    rgba = Image.fromarray(rng.integers(0, 256, (200, 150, 4), dtype=np.uint8), "RGBA")
    palette = rgb.convert("P")
    return [rgb, tall, grey, rgba, palette]


@pytest.mark.parametrize("config", [
    {},  # CLIPImageProcessor's defaults: 224
    {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}},  # LLaVA-1.5's
    {"size": {"height": 96, "width": 64}, "do_center_crop": False, "image_mean": [0.5, 0.5, 0.5],
     "image_std": [0.5, 0.5, 0.5], "resample": 2},  # a fixed size, bilinear (SigLIP-like)
])
def test_pixel_values_are_transformers_processors(config):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    theirs = CLIPImageProcessorPil(**config)
    ours = ClipPreprocessor.from_config(config)
    for img in _images():
        want = theirs(images=[img], return_tensors="np")["pixel_values"][0]
        got = ours.pixel_values(img)
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want), (img.mode, img.size, config)
