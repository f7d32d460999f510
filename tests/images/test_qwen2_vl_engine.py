"""Qwen2-VL on the engine (issue 34, engine level): an image's patches through the vision encoder (2-D rotary, the
patch merger) into its `<|image_pad|>` placeholders, with M-RoPE: (temporal, height, width) positions for the
placeholders, text after an image and generated tokens continuing from them. Greedy tokens equal transformers'
generate (fp32) for rows of no image, one image and two images of different grids, batched, alone and split across
steps; the encoder equals transformers' get_image_features; bf16 sampled text alone = batched; a saved folder loads."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from batchjob.engine.requests import ImageSlot, SamplingParams
from batchjob.models.registry import build_model, canonical_weights, config_from_hf
from tests.images.engine_cases import GREEDY, engine_for, hf_greedy, run_rows, saved_and_loaded

transformers = pytest.importorskip("transformers")
PAD, START, END = 599, 597, 596  # <|image_pad|>, <|vision_start|>, <|vision_end|>
PATCH = 3 * 2 * 14 * 14


def make_qwen2_vl(hidden: int = 48, sections=(2, 2, 2), kind: str = "Qwen2VL"):
    vision = dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=4, mlp_ratio=2, hidden_act="quick_gelu",
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if kind == "Qwen2_5_VL":  # windows of 2 x 2 merged blocks (56 px), block 0 windowed, block 1 full
        vision = dict(depth=2, hidden_size=32, out_hidden_size=hidden, intermediate_size=48, num_heads=4,
                      hidden_act="silu", patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                      fullatt_block_indexes=[1])
    text = dict(vocab_size=600, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(sections)})
    cfg = getattr(transformers, f"{kind}Config")(vision_config=vision, text_config=text, image_token_id=PAD,
                                                 video_token_id=598, vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that make images and their positions matter
            if p.ndim > 1 or "visual" in name:
                p.normal_(0, 0.2 if "visual" in name else 0.12)
    return model


@pytest.fixture(scope="module")
def hf_qwen2_vl():
    return make_qwen2_vl()


def ours(hf, kernels: str = "torch", dtype: torch.dtype = torch.float32):
    d = hf.config.to_dict()
    d["architectures"] = [type(hf).__name__]
    config = config_from_hf(d)
    weights = canonical_weights(config, {k: v.detach().clone().to(dtype) for k, v in hf.state_dict().items()})
    return build_model(config, weights, dtype, kernels=kernels)


def patches(seed: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((h * w, PATCH)).astype(np.float32)


def image_ids(h: int, w: int) -> list[int]:
    return [START] + [PAD] * (h * w // 4) + [END]


def rows() -> list[tuple[list[int], list[tuple[int, int, int]]]]:
    """(prompt ids, [(seed, grid h, grid w)]): patch grids of 4 x 6 and 6 x 2."""
    return [([1, 5, 7] + image_ids(4, 6) + [9, 11], [(1, 4, 6)]),
            ([1, 5] + image_ids(6, 2) + [21, 22] + image_ids(4, 6) + [23], [(2, 6, 2), (3, 4, 6)]),
            ([1, 20, 30, 40, 50], []),
            ([1, 5, 7] + image_ids(4, 6) + [9, 11], [(4, 4, 6)])]


def slots(ids: list[int], images) -> tuple[ImageSlot, ...]:
    runs = [i for i in range(len(ids)) if ids[i] == PAD and ids[i - 1] != PAD]
    out = []
    for at, (seed, h, w) in zip(runs, images):
        pv = patches(seed, h, w).reshape(1, h, w, PATCH)
        out.append(ImageSlot(at, h * w // 4, hashlib.sha256(pv.tobytes()).hexdigest(), pv))
    return tuple(out)


def reference(hf, ids, images) -> list[int]:
    kw = {}
    if images:
        kw = {"pixel_values": torch.from_numpy(np.concatenate([patches(s, h, w) for s, h, w in images])),
              "image_grid_thw": torch.tensor([[1, h, w] for _, h, w in images]),
              "mm_token_type_ids": torch.tensor([[int(t == PAD) for t in ids]])}
    return hf_greedy(hf, ids, **kw)


def run(model, which: list[int], budget: int = 2048, params: SamplingParams = GREEDY, block_size: int = 8):
    return run_rows(engine_for(model, budget, block_size), rows(), slots, which, params)[0]


def test_the_image_encoder_is_transformers_get_image_features(hf_qwen2_vl):
    model = ours(hf_qwen2_vl)
    pv = patches(7, 4, 6)
    with torch.no_grad():
        want = hf_qwen2_vl.model.get_image_features(torch.from_numpy(pv), torch.tensor([[1, 4, 6]])).pooler_output[0]
    got = model.image_encoder(torch.from_numpy(pv.reshape(1, 1, 4, 6, PATCH)))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_greedy_tokens_are_transformers_batched_alone_and_split(hf_qwen2_vl, kernels):
    model = ours(hf_qwen2_vl, kernels)
    want = [reference(hf_qwen2_vl, ids, images) for ids, images in rows()]
    assert want[0] != want[3]  # the same text with another image: another answer
    assert run(model, [0, 1, 2, 3]) == want
    assert [run(model, [i])[0] for i in range(4)] == want  # alone = batched
    assert run(model, [0, 1, 2, 3], budget=5) == want  # 5 tokens a step: placeholders split across steps


def test_qwen2_5_vl_window_attention_and_its_tower():
    """Qwen2.5-VL: RMSNorms, a gated MLP, attention within windows (block 0) and over the image (block 1); grids of
    2 x 3 and 3 x 1 merged blocks make whole and cut windows."""
    hf = make_qwen2_vl(kind="Qwen2_5_VL")
    model = ours(hf)
    pv = patches(7, 4, 6)
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pv), torch.tensor([[1, 4, 6]])).pooler_output[0]
    torch.testing.assert_close(model.image_encoder(torch.from_numpy(pv.reshape(1, 1, 4, 6, PATCH)))[0], want,
                               rtol=1e-5, atol=1e-5)
    assert run(model, [0, 1, 2]) == [reference(hf, ids, images) for ids, images in rows()[:3]]


def test_bf16_sampled_rows_alone_equal_batched():
    model = ours(make_qwen2_vl(hidden=64, sections=(2, 3, 3)), "auto", torch.bfloat16)  # head size 16: native kernels
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched = run(model, [0, 1, 2, 3], params=sampled, block_size=16)
    assert [run(model, [i], params=sampled, block_size=16)[0] for i in range(4)] == batched


def test_a_saved_folder_loads_and_gives_the_same_tokens(hf_qwen2_vl, tiny_tokenizer_dir, tmp_path):
    _, model = saved_and_loaded(hf_qwen2_vl, tiny_tokenizer_dir, tmp_path / "qwen2-vl", "qwen2_vl")
    assert run(model, [0, 2]) == [reference(hf_qwen2_vl, *rows()[i]) for i in (0, 2)]
