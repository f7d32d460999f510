"""What one image becomes in a prompt, per family: the token ids that replace the chat template's image token, and
the placeholder runs among them with the pixel values each run's encoder output comes from (one run for LLaVA's,
Qwen2-VL's and Gemma 3's image; one per tile for Idefics3's split image). The ids and pixel values are those of the family's
transformers processor (tests/images/)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
from PIL import Image

from batchjob.images.clip import ClipPreprocessor
from batchjob.images.idefics3 import Idefics3Preprocessor, image_prompt
from batchjob.images.qwen2_vl import Qwen2VLPreprocessor


class ImageLayout(Protocol):
    image_token_id: int  # the chat template's image token (a placeholder too, but for Gemma 3's)
    bidirectional: bool  # a placeholder run's tokens attend to each other both ways (Gemma 3)

    def place(self, image: Image.Image) -> tuple[list[int], list[tuple[int, int, np.ndarray]]]:
        """(the ids the image token becomes, [(a placeholder run's start in them, its length, its pixel values)])."""
        ...

    def template_text(self, text: str) -> str:
        """A rendered chat template's text as the family's processor rewrites it before tokenizing (Gemma 3 puts blank
        lines around each image; the others leave it as it is)."""
        ...


class _AsRendered:
    """The layouts whose processor tokenizes the rendered template as it is, with causal image runs."""
    __slots__ = ()
    bidirectional: ClassVar[bool] = False

    def template_text(self, text: str) -> str:
        return text


@dataclass(frozen=True, slots=True)
class LlavaLayout(_AsRendered):
    """The image token repeated once per row of the encoder's output, all from one resized, cropped image."""
    image_token_id: int
    tokens_per_image: int
    preprocessor: ClipPreprocessor

    def place(self, image: Image.Image) -> tuple[list[int], list[tuple[int, int, np.ndarray]]]:
        return [self.image_token_id] * self.tokens_per_image, [(0, self.tokens_per_image, self.preprocessor.pixel_values(image))]


@dataclass(frozen=True, slots=True)
class Idefics3Layout(_AsRendered):
    """Idefics3Processor's layout: each tile as `<fake_token_around_image><row_r_col_c>` and its placeholders, a
    newline after each row of tiles, then the global image; the text tokenized once per grid shape."""
    image_token_id: int
    image_seq_len: int
    preprocessor: Idefics3Preprocessor
    tokenizer: object  # batchjob.models.tokenizer.Tokenizer
    _ids: dict[tuple[int, int], tuple[list[int], list[int]]] = field(default_factory=dict)

    def place(self, image: Image.Image) -> tuple[list[int], list[tuple[int, int, np.ndarray]]]:
        tiles, rows, cols = self.preprocessor.tiles(image)
        ids, starts = self._grid(rows, cols)
        if len(starts) != len(tiles):
            raise ValueError(f"the image prompt has {len(starts)} placeholder runs for {len(tiles)} tiles")
        return ids, [(at, self.image_seq_len, t) for at, t in zip(starts, tiles)]

    def _grid(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        got = self._ids.get((rows, cols))
        if got is None:
            ids = self.tokenizer.encode(image_prompt(rows, cols, self.image_seq_len), add_special_tokens=False)
            tok = self.image_token_id
            starts = [i for i, t in enumerate(ids) if t == tok and (i == 0 or ids[i - 1] != tok)]
            got = self._ids[rows, cols] = (ids, starts)
        return got


IMAGE_SETTINGS, PROCESSOR_SETTINGS = "preprocessor_config.json", "processor_config.json"


def image_settings(folder: Path) -> dict | None:
    """The image processor's settings a model folder holds: preprocessor_config.json (the Hub's checkpoints, an image
    processor saved alone), else the `image_processor` of processor_config.json (transformers 5 saves a whole
    processor so); None: neither."""
    if (folder / IMAGE_SETTINGS).is_file():
        return json.loads((folder / IMAGE_SETTINGS).read_text())
    if (folder / PROCESSOR_SETTINGS).is_file():
        return json.loads((folder / PROCESSOR_SETTINGS).read_text()).get("image_processor")
    return None


@dataclass(frozen=True, slots=True)
class Qwen2VLLayout(_AsRendered):
    """One `<|image_pad|>` per merged patch block (the template writes the vision start and end tokens around the
    image token); the patches carry their grid, [t, h, w, patch dims], for the encoder and the M-RoPE positions."""
    image_token_id: int
    preprocessor: Qwen2VLPreprocessor

    def place(self, image: Image.Image) -> tuple[list[int], list[tuple[int, int, np.ndarray]]]:
        flat, grid = self.preprocessor.patches(image)
        n = self.preprocessor.num_placeholders(grid)
        return [self.image_token_id] * n, [(0, n, flat.reshape(*grid, flat.shape[-1]))]


@dataclass(frozen=True, slots=True)
class Gemma3Layout:
    """Gemma3Processor's layout: the template's `<start_of_image>` becomes blank lines, itself, one
    `<image_soft_token>` per row of the encoder's output and `<end_of_image>`, blank lines; the blank lines are written
    into the text before tokenizing, as the processor does (they merge with the newlines around them). The image is
    resized to the tower's square without a crop; its placeholders attend to each other both ways."""
    image_token_id: int  # <start_of_image>
    placeholder_id: int  # <image_soft_token>
    end_id: int  # <end_of_image>
    tokens_per_image: int
    start_text: str  # <start_of_image> as text
    preprocessor: ClipPreprocessor
    bidirectional: ClassVar[bool] = True

    def place(self, image: Image.Image) -> tuple[list[int], list[tuple[int, int, np.ndarray]]]:
        ids = [self.image_token_id] + [self.placeholder_id] * self.tokens_per_image + [self.end_id]
        return ids, [(1, self.tokens_per_image, self.preprocessor.pixel_values(image))]

    def template_text(self, text: str) -> str:
        return text.replace(self.start_text, f"\n\n{self.start_text}\n\n")


def gemma3_layout(extra: dict, settings: dict, tokenizer) -> Gemma3Layout:
    if settings.get("do_pan_and_scan"):
        raise ValueError("do_pan_and_scan: Gemma 3's pan-and-scan crops are not supported (turn it off)")
    size = settings.get("size") or {}
    if "height" not in size or "width" not in size:
        raise ValueError(f"size {size}: Gemma 3's processor resizes to a fixed height and width")
    seq = settings.get("image_seq_length", extra["tokens_per_image"])
    if seq != extra["tokens_per_image"]:
        raise ValueError(f"image_seq_length {seq}; the model's projector gives {extra['tokens_per_image']} per image")
    start = tokenizer.decode([extra["boi_token_id"]], skip_special_tokens=False)
    prep = ClipPreprocessor.from_config({**settings, "do_center_crop": False})
    return Gemma3Layout(extra["boi_token_id"], extra["image_token_id"], extra["eoi_token_id"], seq, start, prep)


def layout_for(architecture: str, extra: dict, folder: Path, settings: dict, tokenizer) -> ImageLayout:
    """The layout of a vision-language model's folder, from its image processor's settings. ValueError names a setting
    we cannot honour."""
    token = extra["image_token_id"]
    if architecture == "qwen2_vl":
        prep = Qwen2VLPreprocessor.from_config(settings)
        if prep.merge_size != extra["mrope_merge"]:
            raise ValueError(f"merge_size {prep.merge_size}; the model's vision tower merges {extra['mrope_merge']}")
        return Qwen2VLLayout(token, prep)
    if architecture == "gemma3_vl":
        return gemma3_layout(extra, settings, tokenizer)
    per_run = extra["tokens_per_image"]
    if architecture == "idefics3":
        processor = folder / PROCESSOR_SETTINGS
        seq = json.loads(processor.read_text()).get("image_seq_len", per_run) if processor.is_file() else per_run
        if seq != per_run:
            raise ValueError(f"{processor}: image_seq_len {seq}; the model's vision tower gives {per_run} per tile")
        return Idefics3Layout(token, per_run, Idefics3Preprocessor.from_config(settings), tokenizer)
    return LlavaLayout(token, per_run, ClipPreprocessor.from_config(settings))
