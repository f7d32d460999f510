"""Gemma 3 with images on the engine (issue 34, engine level): each image is `<start_of_image>`, a run of
`<image_soft_token>` placeholders taking the SigLIP tower's pooled, projected rows, and `<end_of_image>`; the run's
tokens attend to each other both ways (transformers' token_type_ids mask), within the sliding window on the local
layers. Greedy tokens equal transformers' generate (fp32) for rows of no image, one and two images, batched, alone
and with a token budget that would split a run (the scheduler keeps a run whole in one step), on the torch and the
default kernels; a run longer than the budget fails its row alone; the encoder equals get_image_features; a saved
folder loads under our names."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from batchjob.engine.config import EngineConfig
from batchjob.engine.engine import Engine
from batchjob.engine.requests import EngineRequest, ImageSlot, SamplingParams
from batchjob.models.registry import build_model, canonical_weights, config_from_hf
from tests.images.engine_cases import GREEDY, engine_for, hf_greedy, run_rows, saved_and_loaded

transformers = pytest.importorskip("transformers")
BOI, EOI, SOFT = 597, 598, 599  # <start_of_image>, <end_of_image>, <image_soft_token>
SIDE, RUN = 112, 16  # image px (8 x 8 patches of 14); placeholders per image (pooled 2 x 2)


def make_gemma3(window: int = 12, seed: int = 5):
    text = dict(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=window,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"], rms_norm_eps=1e-6,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})  # the 4B-27B's
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                  image_size=SIDE)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=RUN,
                                    boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that make images matter (default init: flat)
            vision_part = "vision_tower" in name or "multi_modal" in name
            if p.ndim > 1 or vision_part:
                p.normal_(0, 0.2 if vision_part else 0.02)
    return model


@pytest.fixture(scope="module")
def hf_gemma3():
    return make_gemma3()


def ours(hf, kernels: str = "torch", dtype: torch.dtype = torch.float32):
    d = hf.config.to_dict()
    d["architectures"] = [type(hf).__name__]
    config = config_from_hf(d)
    weights = canonical_weights(config, {k: v.detach().clone().to(dtype) for k, v in hf.state_dict().items()})
    return build_model(config, weights, dtype, kernels=kernels)


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, SIDE, SIDE)).astype(np.float32)


IMG = [BOI] + [SOFT] * RUN + [EOI]


def rows() -> list[tuple[list[int], list[int]]]:
    """(prompt ids, image seeds in order)"""
    return [([2, 5, 7] + IMG + [9, 11], [1]),
            ([2, 5] + IMG + [21] + IMG + [22, 23], [2, 3]),
            ([2, 20, 30, 40, 50], []),
            ([2, 5, 7] + IMG + [9, 11], [4])]


def slots(ids: list[int], seeds: list[int]) -> tuple[ImageSlot, ...]:
    runs = [i for i in range(len(ids)) if ids[i] == SOFT and ids[i - 1] != SOFT]
    assert len(runs) == len(seeds)
    return tuple(ImageSlot(at, RUN, hashlib.sha256(pixels(s).tobytes()).hexdigest(), pixels(s), bidirectional=True)
                 for at, s in zip(runs, seeds))


def reference(hf, ids, seeds) -> list[int]:
    kw = {}
    if seeds:
        kw = {"pixel_values": torch.from_numpy(np.stack([pixels(s) for s in seeds])),
              "token_type_ids": (torch.tensor([ids]) == SOFT).long()}
    return hf_greedy(hf, ids, **kw)


def run(model, which: list[int], budget: int = 2048, params: SamplingParams = GREEDY, block_size: int = 8):
    """Each row's output ids, or its error (a row refused at submission, or failed)."""
    return run_rows(engine_for(model, budget, block_size), rows(), slots, which, params, errors=True)[0]


def test_the_image_encoder_is_transformers_get_image_features(hf_gemma3):
    model = ours(hf_gemma3)
    pv = torch.from_numpy(np.stack([pixels(7), pixels(8)]))
    with torch.no_grad():
        want = hf_gemma3.model.get_image_features(pv).pooler_output
    torch.testing.assert_close(model.image_encoder(pv), want, rtol=1e-5, atol=1e-5)


def test_the_image_runs_attend_both_ways_in_transformers(hf_gemma3):
    """The reference itself: without token_type_ids transformers masks causally and answers otherwise, so the
    comparisons below test the bidirectional runs."""
    ids, seeds = rows()[1]
    with torch.no_grad():
        causal = hf_gemma3.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                    pixel_values=torch.from_numpy(np.stack([pixels(s) for s in seeds])))
    assert causal[0, len(ids):].tolist() != reference(hf_gemma3, ids, seeds)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_greedy_tokens_are_transformers_batched_alone_and_with_a_small_budget(hf_gemma3, kernels):
    model = ours(hf_gemma3, kernels)
    want = [reference(hf_gemma3, ids, seeds) for ids, seeds in rows()]
    assert want[0] != want[3]  # the same text with another image: another answer
    assert run(model, [0, 1, 2, 3]) == want
    assert [run(model, [i])[0] for i in range(4)] == want  # alone = batched
    assert run(model, [0, 1, 2, 3], budget=RUN + 3) == want  # a chunk ends before a run or takes it whole


def test_a_prefix_hit_ending_inside_an_image_run_gives_the_same_tokens(hf_gemma3):
    """The same row again: its first two blocks (tokens 0-15) are cached, so its computation resumes inside the image
    run (positions 4-19): the run's rest goes whole in one step and sees the cached part of the run."""
    engine = Engine(ours(hf_gemma3), [], EngineConfig(num_blocks=256, block_size=8, enable_prefix_caching=True))
    ids, seeds = rows()[0]
    want, hits = reference(hf_gemma3, ids, seeds), []
    for _ in range(2):
        seq = engine.submit(EngineRequest(ids, GREEDY, seed=0, row_index=0, images=slots(ids, seeds)))
        got, hit = None, 0
        while engine.has_work:
            for r in engine.run_step():
                got = list(r.output_ids)
            hit += engine.last_stats.prefix_hit_tokens if engine.last_stats else 0
        assert isinstance(seq, int) and got == want
        hits.append(hit)
    assert hits == [0, 16]


def test_a_run_longer_than_the_token_budget_fails_its_row_alone(hf_gemma3):
    got = run(ours(hf_gemma3), [0, 2], budget=RUN - 1)
    assert "max_num_batched_tokens" in got[0] and f"at least {RUN}" in got[0]
    assert got[1] == reference(hf_gemma3, *rows()[2])


def test_bf16_sampled_rows_alone_equal_batched():
    model = ours(make_gemma3(), "auto", torch.bfloat16)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched = run(model, [0, 1, 2, 3], params=sampled, block_size=16)
    assert [run(model, [i], params=sampled, block_size=16)[0] for i in range(4)] == batched


def test_a_saved_folder_loads_and_gives_the_same_tokens(hf_gemma3, tiny_tokenizer_dir, tmp_path):
    loaded, model = saved_and_loaded(hf_gemma3, tiny_tokenizer_dir, tmp_path / "gemma3", "gemma3_vl")
    assert loaded.config.extra["tokens_per_image"] == RUN
    assert run(model, [0, 2]) == [reference(hf_gemma3, *rows()[i]) for i in (0, 2)]
