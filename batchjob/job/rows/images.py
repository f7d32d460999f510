"""A job's image rows (issue 34): a chat row's `image_url` parts read (batchjob/images/sources.py: data: URIs, paths
relative to the input file, file://, http(s)), each rendered by the chat template as the model's image token, and
after tokenizing, each image token replaced by what the image becomes in the family's layout (images/layouts.py:
LLaVA's one run of placeholders, Idefics3's tiles), each placeholder run with its pixel values (as transformers'
processor computes them) and a content digest: the row's ImageSlots for its EngineRequest. A row whose image cannot be read, decoded or fit fails alone, naming the message and the part (the
prompt builder names them: job/rows/prompt_builder.py)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from batchjob.engine.requests import ImageSlot
from batchjob.images.layouts import IMAGE_SETTINGS, ImageLayout, image_settings, layout_for
from batchjob.images.sources import Fetched, ImageError, ImageInput, from_pil, from_url
from batchjob.models.loader import LoadedModel, ModelLoadError

IMAGE_PARTS = ("image_url", "image", "input_image")  # OpenAI's chat and Responses names, and transformers'


@dataclass(frozen=True, slots=True)
class ImageRows:
    layout: ImageLayout  # what an image becomes in the prompt (the family's: images/layouts.py)

    @property
    def image_token_id(self) -> int:
        return self.layout.image_token_id

    @classmethod
    def of(cls, loaded: LoadedModel, folder: Path | None) -> ImageRows | None:
        """The model's image facts; None for a text-only model. Raises ModelLoadError for a vision-language model
        folder without its image processor's settings, or with settings we cannot honour."""
        extra = loaded.config.extra
        if "image_token_id" not in extra or folder is None or not folder.is_dir():
            return None
        settings = image_settings(folder)
        if settings is None:
            raise ModelLoadError(f"{folder / IMAGE_SETTINGS}: missing: a vision-language model folder needs its image "
                                 "processor's settings (the file transformers' processor saves with the model)")
        try:
            return cls(layout_for(loaded.config.architecture, extra, folder, settings, loaded.tokenizer))
        except ValueError as e:
            raise ModelLoadError(f"{folder}: image processor settings: {e}") from None

    def expand(self, ids: list[int], images: list[ImageInput]) -> tuple[list[int], tuple[ImageSlot, ...]]:
        """The rendered prompt's ids with each image token replaced by what its image becomes (its placeholder runs
        and the tokens around them), and a slot per placeholder run: where it is, the pixel values its encoder output
        comes from, and a digest of the image and the run's place in it (the prefix cache's key)."""
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(at) != len(images):
            raise ImageError(f"the chat template wrote {len(at)} image tokens for {len(images)} images; a template "
                             "that renders each image part as the model's image token is needed")
        out: list[int] = []
        slots, prev = [], 0
        for pos, img in zip(at, images):
            out.extend(ids[prev:pos])
            placed, runs = self.layout.place(img.image)
            for k, (start, length, pixels) in enumerate(runs):
                digest = img.digest if len(runs) == 1 else hashlib.sha256(f"{img.digest}:{k}".encode()).hexdigest()
                slots.append(ImageSlot(len(out) + start, length, digest, pixels, self.layout.bidirectional))
            out.extend(placed)
            prev = pos + 1
        out.extend(ids[prev:])
        return out, tuple(slots)


def image_part(part: dict, base: Path | None, fetched: Fetched | None = None) -> ImageInput:
    """An OpenAI image part (`{"type": "image_url", "image_url": {"url": ...}}`, or the Responses API's
    `{"type": "input_image", "image_url": ...}`), or the Python API's `{"type": "image", "image": PIL image}`, read
    and decoded; ImageError says why not. `fetched`: http(s) urls fetched already (sources.fetch_many)."""
    url = part_url(part)
    if isinstance(url, Image.Image):
        return from_pil(url)
    return from_url(url, base, fetched=fetched)


def part_url(part: dict):
    """An image part's url (or the API's PIL image)."""
    ref = part.get("image_url") if part.get("type") != "image" else part.get("image")
    return ref.get("url") if isinstance(ref, dict) else ref
