"""Idefics3 / SmolVLM on the engine (issue 34, engine level): each tile of an image is its own placeholder run (the
processor's layout: `<fake_token_around_image><row_r_col_c>` + tile placeholders per tile, then the global image),
encoded by the SigLIP tower and the pixel-shuffle connector; greedy tokens equal transformers' generate (fp32) for
rows of no image, a split image and two images, batched, alone and split across steps; the image encoder's output
equals transformers' get_image_features; a saved folder loads under our names."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from batchjob.engine.requests import ImageSlot, SamplingParams
from batchjob.models.registry import build_model, canonical_weights, config_from_hf
from tests.images.engine_cases import GREEDY, engine_for, hf_greedy, run_rows, saved_and_loaded

transformers = pytest.importorskip("transformers")
IMAGE, FAKE, GLOBAL, NL = 599, 598, 597, 13  # <image>, <fake_token_around_image>, <global-img>, "\n"
ROW_COL = {(r, c): 580 + 4 * r + c for r in range(1, 4) for c in range(1, 4)}  # <row_r_col_c>
SIDE, SEQ = 56, 4  # tile px; placeholders per tile: (56 / 14)^2 patches / 2^2


def make_idefics3(hidden: int = 48, kind: str = "Idefics3"):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                  image_size=SIDE)
    text = dict(vocab_size=600, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    cfg = getattr(transformers, f"{kind}Config")(vision_config=vision, text_config=text, image_token_id=IMAGE,
                                                 scale_factor=2)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that make images matter (default init: flat)
            if p.ndim > 1 or "vision_model" in name or "connector" in name:
                p.normal_(0, 0.2 if ("vision_model" in name or "connector" in name) else 0.12)
    return model


@pytest.fixture(scope="module")
def hf_idefics3():
    return make_idefics3()


def ours(hf, kernels: str = "torch", dtype: torch.dtype = torch.float32):
    d = hf.config.to_dict()
    d["architectures"] = [type(hf).__name__]
    config = config_from_hf(d)
    weights = canonical_weights(config, {k: v.detach().clone().to(dtype) for k, v in hf.state_dict().items()})
    return build_model(config, weights, dtype, kernels=kernels)


def tiles(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIDE, SIDE)).astype(np.float32)


def image_ids(rows: int, cols: int) -> list[int]:
    """One image as Idefics3Processor lays it out: its tiles row by row, then the global image."""
    if not rows:
        return [FAKE, GLOBAL] + [IMAGE] * SEQ + [FAKE]
    out = []
    for r in range(1, rows + 1):
        for c in range(1, cols + 1):
            out += [FAKE, ROW_COL[r, c]] + [IMAGE] * SEQ
        out.append(NL)
    return out + [NL, FAKE, GLOBAL] + [IMAGE] * SEQ + [FAKE]


def rows() -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """(prompt ids, [(image seed, rows, cols)])"""
    return [([1, 5, 7] + image_ids(2, 2) + [9, 11], [(1, 2, 2)]),
            ([1, 5] + image_ids(0, 0) + [21] + image_ids(1, 2) + [22, 23], [(2, 0, 0), (3, 1, 2)]),
            ([1, 20, 30, 40, 50], []),
            ([1, 5, 7] + image_ids(2, 2) + [9, 11], [(4, 2, 2)])]


def slots(ids: list[int], images: list[tuple[int, int, int]]) -> tuple[ImageSlot, ...]:
    runs = [i for i in range(len(ids)) if ids[i] == IMAGE and (i == 0 or ids[i - 1] != IMAGE)]
    pv = np.concatenate([tiles(seed, r * c + 1) for seed, r, c in images]) if images else np.zeros((0,))
    assert len(runs) == len(pv)
    return tuple(ImageSlot(at, SEQ, hashlib.sha256(t.tobytes()).hexdigest(), t) for at, t in zip(runs, pv))


def reference(hf, ids, images) -> list[int]:
    kw = {}
    if images:
        pv = np.concatenate([tiles(seed, r * c + 1) for seed, r, c in images])
        kw = {"pixel_values": torch.from_numpy(pv)[None]}
    return hf_greedy(hf, ids, **kw)


def run(model, which: list[int], budget: int = 2048, params: SamplingParams = GREEDY, block_size: int = 8):
    return run_rows(engine_for(model, budget, block_size), rows(), slots, which, params)[0]


def test_the_image_encoder_is_transformers_get_image_features(hf_idefics3):
    model = ours(hf_idefics3)
    pv = torch.from_numpy(tiles(7, 3))
    with torch.no_grad():
        want = hf_idefics3.model.get_image_features(pv[None]).pooler_output[0].view(3, SEQ, -1)
    torch.testing.assert_close(model.image_encoder(pv), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_greedy_tokens_are_transformers_batched_alone_and_split(hf_idefics3, kernels):
    model = ours(hf_idefics3, kernels)
    want = [reference(hf_idefics3, ids, images) for ids, images in rows()]
    assert want[0] != want[3]  # the same text with another image: another answer
    assert run(model, [0, 1, 2, 3]) == want
    assert [run(model, [i])[0] for i in range(4)] == want  # alone = batched
    assert run(model, [0, 1, 2, 3], budget=7) == want  # 7 tokens a step: tiles' placeholders split across steps


def test_smolvlm2_folders_run_as_idefics3():
    """SmolVLM2 (`SmolVLMForConditionalGeneration`): Idefics3's layout and weights under its own names."""
    hf = make_idefics3(kind="SmolVLM")
    assert hf.config.vision_config.model_type == "smolvlm_vision"
    assert run(ours(hf), [0, 1, 2]) == [reference(hf, ids, images) for ids, images in rows()[:3]]


def test_bf16_sampled_rows_alone_equal_batched():
    model = ours(make_idefics3(hidden=64), "auto", torch.bfloat16)  # head size 16: the native kernels take it
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched = run(model, [0, 1, 2, 3], params=sampled, block_size=16)
    assert [run(model, [i], params=sampled, block_size=16)[0] for i in range(4)] == batched


def test_a_saved_folder_loads_and_gives_the_same_tokens(hf_idefics3, tiny_tokenizer_dir, tmp_path):
    loaded, model = saved_and_loaded(hf_idefics3, tiny_tokenizer_dir, tmp_path / "idefics3", "idefics3")
    assert loaded.config.extra["tokens_per_image"] == SEQ
    assert run(model, [0, 2]) == [reference(hf_idefics3, *rows()[i]) for i in (0, 2)]
