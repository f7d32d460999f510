"""Our Idefics3 / SmolVLM pixel values, tile grid and prompt text equal transformers' Idefics3ImageProcessorPil and
Idefics3Processor's, value for value: noise images smaller than a tile, exactly a tile, wide, tall, larger than the
longest edge, grey and transparent; split and unsplit; small settings and SmolVLM-256M's."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from batchjob.images.idefics3 import Idefics3Preprocessor, image_prompt

transformers = pytest.importorskip("transformers")
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil  # noqa: E402

SMALL = {"size": {"longest_edge": 4 * 56}, "max_image_size": {"longest_edge": 56}}
SMOLVLM_256M = {"size": {"longest_edge": 2048}, "max_image_size": {"longest_edge": 512}, "resample": 1,
                "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_pad": True,
                "rescale_factor": 0.00392156862745098, "video_sampling": {"fps": 1}}


def _noise(w: int, h: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _images(tile: int) -> list[Image.Image]:
    return [
        Image.fromarray(_noise(tile // 2 + 3, tile // 3, seed=1)),  # smaller than a tile (scaled up)
        Image.fromarray(_noise(tile, tile, seed=2)),  # exactly a tile
        Image.fromarray(_noise(900, 300, seed=3)),  # wide
        Image.fromarray(_noise(251, 777, seed=4)),  # tall, odd sizes
        Image.fromarray(_noise(2000, 1500, seed=5)),  # larger than longest_edge
        Image.fromarray(_noise(301, 199, 1, seed=6)),  # grey ("L")
        Image.fromarray(_noise(333, 222, 4, seed=7), "RGBA"),  # transparency composited onto white
    ]


def _theirs(config: dict, img: Image.Image) -> tuple[list[np.ndarray], int, int]:
    out = Idefics3ImageProcessorPil(**config)(images=[[img]], return_tensors="np", return_row_col_info=True)
    return list(out["pixel_values"][0]), out["rows"][0][0], out["cols"][0][0]


def _assert_same(ours: Idefics3Preprocessor, config: dict, img: Image.Image) -> None:
    want, rows, cols = _theirs(config, img)
    got, got_rows, got_cols = ours.tiles(img)
    assert (got_rows, got_cols) == (rows, cols), (img.mode, img.size, config)
    assert len(got) == len(want) == (rows * cols + 1 if rows else 1)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and g.shape == w.shape == (3, ours.tile, ours.tile)
        assert np.array_equal(g, w), (img.mode, img.size, config)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("config", [SMALL, {**SMALL, "resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                                            "image_std": [0.26862954, 0.26130258, 0.27577711]}])
def test_small_settings_match_transformers(config, split):
    config = {**config, "do_image_splitting": split}
    ours = Idefics3Preprocessor.from_config(config)
    assert (ours.longest_edge, ours.tile, ours.split) == (224, 56, split)
    for img in _images(56):
        _assert_same(ours, config, img)


@pytest.mark.parametrize("split", [True, False])
def test_smolvlm_256m_settings_match_transformers(split):
    config = {**SMOLVLM_256M, "do_image_splitting": split}
    ours = Idefics3Preprocessor.from_config(config)
    assert ours == Idefics3Preprocessor(2048, 512, split, 1, 0.00392156862745098, (0.5,) * 3, (0.5,) * 3)
    for img in (Image.fromarray(_noise(700, 300, seed=8)), Image.fromarray(_noise(512, 512, seed=9))):
        _assert_same(ours, config, img)
    # 700x300 -> 2048x878 -> 2048x1024: 2 rows of 4 tiles (and the global image) when split
    assert ours.tiles(Image.fromarray(_noise(700, 300)))[1:] == ((2, 4) if split else (0, 0))


@pytest.mark.parametrize("config", [
    {**SMALL, "do_resize": False},  # splitting still rounds up to tile multiples
    {**SMALL, "do_rescale": False},  # normalises uint8 as float32
    {**SMALL, "do_normalize": False},
    {**SMALL, "do_rescale": False, "do_normalize": False},
    {**SMALL, "do_pad": False, "image_mean": 0.25, "image_std": 0.75},
    {**SMALL, "do_center_crop": True, "crop_size": {"height": 8, "width": 8}},  # ignored by Idefics3
    {**SMALL, "do_resize": None, "do_image_splitting": None, "resample": None},  # null: off, and bilinear
    {**SMALL, "do_rescale": None, "do_normalize": None},
])
def test_flags_match_transformers(config):
    ours = Idefics3Preprocessor.from_config(config)
    for img in _images(56)[2:4]:
        _assert_same(ours, config, img)


@pytest.mark.parametrize("bad,field", [
    ({"do_convert_rgb": False}, "do_convert_rgb"),
    ({"size": {"height": 100, "width": 100}}, "size"),
    ({"size": 224}, "size"),
    ({"max_image_size": {"height": 56}}, "max_image_size"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_mean": None}, "image_mean"),  # transformers raises too
    ({"rescale_factor": None}, "rescale_factor"),
])
def test_refuses_settings_it_cannot_honour(bad, field):
    with pytest.raises(ValueError, match=field):
        Idefics3Preprocessor.from_config({**SMALL, **bad})


def test_from_folder_reads_a_saved_processor(tmp_path):
    config = {**SMALL, "resample": 2, "do_image_splitting": True, "image_mean": [0.1, 0.2, 0.3]}
    Idefics3ImageProcessorPil(**config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["size"] == {"longest_edge": 224}
    ours = Idefics3Preprocessor.from_folder(tmp_path)
    assert ours == Idefics3Preprocessor(224, 56, True, 2, 1 / 255, (0.1, 0.2, 0.3), (0.5, 0.5, 0.5))
    _assert_same(ours, config, _images(56)[2])


def _tiny_processor(config: dict, image_seq_len: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    special = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    special += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
    vocab = {t: i for i, t in enumerate(["[UNK]", "\n", " ", "Describe", "this", ":", *special])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|:"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # decode = the tokens joined with nothing, so it gives back the text exactly
    tok.add_special_tokens(special)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    return Idefics3Processor(Idefics3ImageProcessorPil(**config), tokenizer, image_seq_len=image_seq_len), tokenizer


@pytest.mark.parametrize("img,split,rows_cols", [
    (Image.fromarray(_noise(150, 100)), True, (3, 4)),  # 150x100 -> 224x150 -> 224x168: 3 rows, 4 cols
    (Image.fromarray(_noise(150, 100)), False, (0, 0)),
    (Image.fromarray(_noise(56, 56)), None, (0, 0)),  # longest_edge 56: fits one tile, not split though split is on
])
def test_prompt_text_is_the_processors(img, split, rows_cols):
    config = {**SMALL, "do_image_splitting": split} if split is not None else {**SMALL, "size": {"longest_edge": 56}}
    processor, tokenizer = _tiny_processor(config, image_seq_len=5)
    text = "Describe this: <image>\n"
    out = processor(text=text, images=[img], return_text_replacement_offsets=True, return_tensors="np",
                    image_seq_len=7)  # ignored for the text: the processor writes its own image_seq_len (5)
    _, rows, cols = Idefics3Preprocessor.from_config(config).tiles(img)
    assert (rows, cols) == rows_cols
    ours = image_prompt(rows, cols, 5)
    [offset] = out["text_replacement_offsets"][0]
    assert offset["replacement"] == ours
    expanded = text.replace("<image>", ours)
    assert tokenizer.decode(out["input_ids"][0]) == expanded
    assert list(out["input_ids"][0]) == tokenizer(expanded)["input_ids"]
    assert ours.count("<image>") == 5 * (rows * cols + 1)
    if rows:
        assert ours.startswith("<fake_token_around_image><row_1_col_1><image>")
        assert f"<row_{rows}_col_{cols}>" + "<image>" * 5 + "\n\n<fake_token_around_image><global-img>" in ours
    else:
        assert ours == "<fake_token_around_image><global-img>" + "<image>" * 5 + "<fake_token_around_image>"
    assert ours.endswith("<image><fake_token_around_image>")


def test_prompt_with_custom_tokens():
    assert image_prompt(1, 2, 2, fake_token="F", image_token="I", global_token="G") == (
        "F<row_1_col_1>IIF<row_1_col_2>II\n\nFGIIF")
