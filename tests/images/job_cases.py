"""What every vision-language family's job tests share: a random PNG of a given size, and a model folder begun with
the tiny tokenizer and the family's special tokens added to it."""
from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
from PIL import Image


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB image of `size` (width, height), as PNG bytes."""
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def folder_with_tokens(folder: Path, tokenizer_dir: Path, special: list[str]):
    """`folder` with the tiny tokenizer's files, `special` added to its tokenizer.json: the tokenizer."""
    from tokenizers import Tokenizer

    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(special)
    tok.save(str(folder / "tokenizer.json"))
    return tok
