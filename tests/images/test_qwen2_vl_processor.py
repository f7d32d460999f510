"""Our Qwen2-VL / Qwen2.5-VL patches, image grid and placeholder count equal transformers' Qwen2VLImageProcessorPil
and Qwen2VLProcessor's, value for value: noise images below min_pixels, exactly one merge window, odd-sized, wide,
tall, above max_pixels, grey and transparent; small settings, the class defaults and the real checkpoints' config."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from batchjob.images.clip import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from batchjob.images.qwen2_vl import Qwen2VLPreprocessor, smart_resize

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

SMALL = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 64}
# Qwen2-VL-7B-Instruct's and Qwen2.5-VL-7B-Instruct's preprocessor_config.json (the same fields and values)
QWEN2_VL_7B = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
               "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
               "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}


def _noise(w: int, h: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


IMAGES = [
    Image.fromarray(_noise(20, 20, seed=1)),  # below min_pixels: scaled up (to 56x56)
    Image.fromarray(_noise(28, 28, seed=2)),  # rounds to 28x28, under min_pixels: scaled up
    Image.fromarray(_noise(56, 56, seed=3)),  # exactly one 2x2 merge window
    Image.fromarray(_noise(333, 77, seed=4)),  # odd sizes
    Image.fromarray(_noise(70, 42, seed=5)),  # 70/28 = 2.5 and 42/28 = 1.5: round() takes both halves to even (56)
    Image.fromarray(_noise(500, 90, seed=6)),  # wide, above max_pixels: scaled down
    Image.fromarray(_noise(61, 410, seed=7)),  # tall
    Image.fromarray(_noise(1600, 1200, seed=8)),  # large
    Image.fromarray(_noise(5000, 28, seed=9)),  # long and thin: still above max_pixels after flooring
    Image.fromarray(_noise(131, 99, 1, seed=10)),  # grey ("L")
    Image.fromarray(_noise(150, 101, 4, seed=11), "RGBA"),  # transparency composited onto white
]


def _assert_same(ours: Qwen2VLPreprocessor, config: dict, img: Image.Image) -> tuple[int, int, int]:
    want = Qwen2VLImageProcessorPil(**config)(images=[img], return_tensors="np")
    got, grid = ours.patches(img)
    assert [list(grid)] == want["image_grid_thw"].tolist(), (img.mode, img.size, config)
    assert got.dtype == np.float32 and got.shape == want["pixel_values"].shape
    assert got.shape == (grid[0] * grid[1] * grid[2], 3 * ours.temporal_patch_size * ours.patch_size ** 2)
    assert np.array_equal(got, want["pixel_values"]), (img.mode, img.size, config)
    return grid


def test_small_settings_match_transformers():
    ours = Qwen2VLPreprocessor.from_config(SMALL)
    assert ours == Qwen2VLPreprocessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    grids = [_assert_same(ours, SMALL, img) for img in IMAGES]
    assert grids[0] == grids[1] == grids[2] == (1, 4, 4)
    assert grids[4] == (1, 4, 4) and ours.resized_size(42, 70) == (56, 56)
    assert grids[8] == (1, 2, 212) and 28 * 2968 > ours.max_pixels  # smart_resize does not re-check the bounds


def test_batch_concatenates_the_images_patches():
    want = Qwen2VLImageProcessorPil(**SMALL)(images=IMAGES[3:7], return_tensors="np")
    ours = Qwen2VLPreprocessor.from_config(SMALL)
    rows, grids = zip(*(ours.patches(img) for img in IMAGES[3:7]))
    assert np.array_equal(np.concatenate(rows), want["pixel_values"])
    assert [list(g) for g in grids] == want["image_grid_thw"].tolist()


def test_defaults_and_real_checkpoint_config_match_transformers():
    img = Image.fromarray(_noise(640, 480, seed=12))
    assert Qwen2VLPreprocessor.from_config({}) == Qwen2VLPreprocessor()
    assert (Qwen2VLPreprocessor().min_pixels, Qwen2VLPreprocessor().max_pixels) == (56 * 56, 28 * 28 * 1280)
    assert _assert_same(Qwen2VLPreprocessor(), {}, img) == (1, 34, 46)  # 640x480 -> 644x476
    ours = Qwen2VLPreprocessor.from_config(QWEN2_VL_7B)
    assert ours == Qwen2VLPreprocessor(max_pixels=12845056)
    assert _assert_same(ours, QWEN2_VL_7B, img) == (1, 34, 46)


@pytest.mark.parametrize("config", [
    {**SMALL, "do_rescale": False},  # normalises uint8 as float32
    {**SMALL, "do_normalize": False},
    {**SMALL, "do_rescale": False, "do_normalize": False},  # uint8 cast to float32 by the patching
    {**SMALL, "do_rescale": None, "do_normalize": None},  # null flags: off
    {**SMALL, "image_mean": 0.25, "image_std": 0.75, "resample": 1, "rescale_factor": 0.5},
    {**SMALL, "do_center_crop": True, "crop_size": {"height": 8, "width": 8}, "do_pad": True},  # ignored
    {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}},  # the newer size form
    {"size": {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, **SMALL},  # min/max_pixels win
    {"size": {"shortest_edge": 28 * 28 * 8, "longest_edge": 28 * 28 * 16}, "min_pixels": None, "max_pixels": 9000},
    {"size": None, "max_pixels": 28 * 28 * 32},  # null size: the default
    {**SMALL, "patch_size": 7, "merge_size": 3, "temporal_patch_size": 1},
])
def test_settings_match_transformers(config):
    ours = Qwen2VLPreprocessor.from_config(config)
    for img in (IMAGES[3], IMAGES[5], IMAGES[9]):
        _assert_same(ours, config, img)


def test_size_precedence():
    size = {"size": {"shortest_edge": 100, "longest_edge": 5000}}
    got = Qwen2VLPreprocessor.from_config({**size, **SMALL})
    assert (got.min_pixels, got.max_pixels) == (56 * 56, 28 * 28 * 64)
    got = Qwen2VLPreprocessor.from_config({**size, "min_pixels": 300})
    assert (got.min_pixels, got.max_pixels) == (300, 5000)
    got = Qwen2VLPreprocessor.from_config({**size, "min_pixels": None, "max_pixels": 7000})
    assert (got.min_pixels, got.max_pixels) == (100, 7000)
    ip = Qwen2VLImageProcessorPil(**size, min_pixels=300)
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (300, 5000)


@pytest.mark.parametrize("bad,field", [
    ({"do_convert_rgb": False}, "do_convert_rgb"),
    ({"do_convert_rgb": None}, "do_convert_rgb"),
    ({"do_resize": False}, "do_resize"),
    ({"do_resize": None}, "do_resize"),
    ({"min_pixels": None, "size": 224}, "size"),
    ({"min_pixels": None, "size": {"min_pixels": 3136, "max_pixels": 50176}}, "size"),  # transformers raises too
    ({"min_pixels": None, "size": {"longest_edge": 50176}}, "size"),  # transformers raises too
    ({"resample": None}, "resample"),  # transformers raises too
    ({"rescale_factor": None}, "rescale_factor"),  # transformers raises too
    ({"image_mean": None}, "image_mean"),  # transformers raises too
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"patch_size": None}, "patch_size"),
    ({"merge_size": 0}, "merge_size"),
])
def test_refuses_settings_it_cannot_honour(bad, field):
    with pytest.raises(ValueError, match=field):
        Qwen2VLPreprocessor.from_config({**SMALL, **bad})


def test_refuses_aspect_ratio_over_200_like_transformers():
    img = Image.fromarray(_noise(201 * 5, 5))
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLImageProcessorPil(**SMALL)(images=[img], return_tensors="np")
    with pytest.raises(ValueError, match="aspect ratio"):
        Qwen2VLPreprocessor.from_config(SMALL).patches(img)


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as theirs

    rng = np.random.default_rng(13)
    for h, w in rng.integers(1, 3000, (300, 2)):
        if max(h, w) / min(h, w) <= 200:
            for lo, hi in ((56 * 56, 28 * 28 * 64), (3136, 12845056), (3136, 1003520)):
                assert smart_resize(int(h), int(w), 28, lo, hi) == theirs(int(h), int(w), 28, lo, hi), (h, w, lo, hi)


def test_from_folder_reads_a_saved_processor(tmp_path):
    config = {**SMALL, "resample": 2, "image_mean": [0.1, 0.2, 0.3]}
    Qwen2VLImageProcessorPil(**config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["size"] == {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64}
    ours = Qwen2VLPreprocessor.from_folder(tmp_path)
    assert ours == Qwen2VLPreprocessor(56 * 56, 28 * 28 * 64, resample=2, mean=(0.1, 0.2, 0.3))
    _assert_same(ours, config, IMAGES[3])


def _tiny_processor(config: dict):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor

    class NoVideoQwen2VLProcessor(Qwen2VLProcessor):
        """Without torchvision transformers cannot even look up the video processor's base class, so its
        constructor fails for video_processor=None; skip that one check (images never touch the video processor)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    special = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
    vocab = {t: i for i, t in enumerate(["[UNK]", "Describe", "this", "image", ".", *special])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(special)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    return NoVideoQwen2VLProcessor(Qwen2VLImageProcessorPil(**config), tokenizer), vocab


@pytest.mark.parametrize("img", [IMAGES[0], IMAGES[3], IMAGES[7], IMAGES[9]])
def test_num_placeholders_is_the_processors(img):
    processor, vocab = _tiny_processor(SMALL)
    text = "Describe this <|vision_start|><|image_pad|><|vision_end|> image ."
    out = processor(text=[text], images=[img], return_tensors="np")
    ours = Qwen2VLPreprocessor.from_config(SMALL)
    pixels, grid = ours.patches(img)
    assert np.array_equal(pixels, out["pixel_values"])
    ids = out["input_ids"][0].tolist()
    assert ids.count(vocab["<|image_pad|>"]) == ours.num_placeholders(grid) == grid[1] * grid[2] // 4
    start = ids.index(vocab["<|vision_start|>"])
    assert ids[start + 1 + ours.num_placeholders(grid)] == vocab["<|vision_end|>"]  # one contiguous run
