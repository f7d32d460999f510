"""LLaVA-1.5 on the engine (issue 34, engine level): greedy tokens equal to transformers' generate (fp32) for rows
with no image, one image and two images, batched and alone, with the image's placeholders split across steps by a
small token budget; the same image twice is a prefix-cache hit, another image with the same text is not; an image
sent to a text-only model is refused naming why."""
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
IMAGE, TOKENS = 599, 16  # the image token; placeholders per image (56 px / 14 px patches = 4 x 4)


@pytest.fixture(scope="module")
def hf_llava():
    return make_llava(hidden=48)


@pytest.fixture(scope="module")
def hf_llava_native():
    """Head size 16: one the native kernels take (the default fixture's 12 runs the torch kernels)."""
    return make_llava(hidden=64)


def make_llava(hidden: int):
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, patch_size=14, image_size=56)
    text = transformers.LlamaConfig(vocab_size=600, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that make images and tokens matter (default init: flat)
            if p.ndim > 1 or "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if ("vision_tower" in name or "projector" in name) else 0.12)
    return model


def ours(hf, kernels: str, dtype: torch.dtype = torch.float32):
    d = hf.config.to_dict()
    d["architectures"] = ["LlavaForConditionalGeneration"]
    config = config_from_hf(d)
    weights = canonical_weights(config, {k: v.detach().clone().to(dtype) for k, v in hf.state_dict().items()})
    return build_model(config, weights, dtype, kernels=kernels)


def image(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((3, 56, 56)).astype(np.float32)


def slot(ids: list[int], at: int, seed: int) -> ImageSlot:
    pv = image(seed)
    assert ids[at:at + TOKENS] == [IMAGE] * TOKENS
    return ImageSlot(at, TOKENS, hashlib.sha256(pv.tobytes()).hexdigest(), pv)


def rows() -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(prompt ids, [(placeholder offset, image seed)])"""
    one = [1, 5, 7] + [IMAGE] * TOKENS + [9, 11, 13]
    two = [1] + [IMAGE] * TOKENS + [2, 3, 4] + [IMAGE] * TOKENS + [40, 41]
    return [(one, [(3, 1)]), (two, [(1, 2), (20, 3)]), ([1, 20, 30, 40, 50], []), (one, [(3, 4)]), (one, [(3, 1)])]


def reference(hf, ids, images) -> list[int]:
    kw = {"pixel_values": torch.from_numpy(np.stack([image(s) for _, s in images]))} if images else {}
    return hf_greedy(hf, ids, **kw)


def run(model, which: list[int], budget: int = 2048, engine: Engine | None = None, params: SamplingParams = GREEDY,
        block_size: int = 8):
    """(each row's output ids, the prefix-cache hits)"""
    return run_rows(engine or engine_for(model, budget, block_size), rows(),
                    lambda ids, images: tuple(slot(ids, at, s) for at, s in images), which, params)


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_greedy_tokens_are_transformers_batched_alone_and_split(hf_llava, kernels):
    model = ours(hf_llava, kernels)
    want = [reference(hf_llava, ids, images) for ids, images in rows()[:4]]
    assert want[0] != want[3]  # the same text with another image: another answer
    batched, _ = run(model, [0, 1, 2, 3])
    assert batched == want
    assert [run(model, [i])[0][0] for i in range(4)] == want  # alone = batched
    split, _ = run(model, [0, 1, 2, 3], budget=12)  # 12 tokens a step: every image's placeholders over 2-3 steps
    assert split == want


def test_bf16_sampled_image_rows_alone_equal_batched_and_split(hf_llava_native):
    """Batch invariance holds for image rows, the vision tower included: in bf16 on the default kernels (native
    where the CPU has them: head size and block size 16), sampled text alone = batched = split across steps."""
    model = ours(hf_llava_native, "auto", torch.bfloat16)
    sampled = SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)
    batched, _ = run(model, [0, 1, 2, 3, 4], params=sampled, block_size=16)
    assert len({tuple(b) for b in batched}) == 5
    assert [run(model, [i], params=sampled, block_size=16)[0][0] for i in range(5)] == batched
    assert run(model, [0, 1, 2, 3, 4], budget=12, params=sampled, block_size=16)[0] == batched


def test_the_same_image_is_a_prefix_hit_and_another_image_is_not(hf_llava):
    model = ours(hf_llava, "torch")
    engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=8, enable_prefix_caching=True))
    (first,), _ = run(model, [0], engine=engine)
    (other,), hits = run(model, [3], engine=engine)  # row 0's text with another image: its blocks holding the image differ
    assert other != first and hits == 0  # the first block (tokens 0-7) holds image placeholders too: nothing shared
    (again,), hits = run(model, [4], engine=engine)  # row 0's text and image again
    assert again == first and hits == 16  # its full blocks but the last, cached


def test_several_questions_about_one_image_encode_it_once(hf_llava):
    # VQA rows: each image asked about twice, after different text (no prefix shared): the encoder runs once an
    # image, the second row reads the encoder cache, and every row's tokens are those of a run without the cache
    model = ours(hf_llava, "torch")
    def question(k: int, seed: int):
        return [1, 5 + k, 7] + [IMAGE] * TOKENS + [9, 11 + k], [(3, seed)]
    vqa = [question(0, 1), question(1, 2), question(2, 1), question(3, 2), question(4, 1)]
    def slots(ids, images):
        return tuple(slot(ids, at, s) for at, s in images)
    cached = engine_for(model)
    got, hits = run_rows(cached, vqa, slots, list(range(5)))
    uncached = engine_for(model, encoder_cache_tokens=0)
    assert run_rows(uncached, vqa, slots, list(range(5)))[0] == got and hits == 0
    assert (cached.runner.encoder.images, cached.runner.encoder.cached) == (2, 3)
    assert (uncached.runner.encoder.images, uncached.runner.encoder.cached) == (5, 0)
    assert got == [reference(hf_llava, *row) for row in vqa]
    # one at a time too (each row its own step): the cache outlives the rows
    alone = engine_for(model)
    assert [run_rows(alone, vqa, slots, [i])[0][0] for i in range(5)] == got
    assert (alone.runner.encoder.images, alone.runner.encoder.cached) == (2, 3)
    # an encoder budget of one image a step (vLLM's encoder compute budget): the same tokens; the second image waits
    # a step while the rows asking about the first (cached) go on
    per_step = []
    budgeted = engine_for(model, encoder_budget=TOKENS)
    assert run_rows(budgeted, vqa, slots, list(range(5)), images_per_step=per_step)[0] == got
    assert max(per_step) == 1 and sum(per_step) == 2 and per_step[:2] == [1, 1], per_step


def test_an_image_for_a_text_only_model_is_refused(tiny_model):  # noqa: F811
    engine = Engine(tiny_model, [], EngineConfig(num_blocks=64, block_size=8))
    ids = [1, 2] + [7] * TOKENS
    pv = image(0)
    err = engine.submit(EngineRequest(ids, GREEDY, seed=0, row_index=0, images=(ImageSlot(2, TOKENS, "d", pv),)))
    assert str(err) == "images: this model is a text-only model; images need a vision-language model"


def test_a_saved_llava_folder_loads_and_gives_the_same_tokens(hf_llava, tiny_tokenizer_dir, tmp_path):
    """What save_pretrained writes (language_model.model.*, vision_tower.*, multi_modal_projector.*) loads through
    the HF folder loader under our names, and runs as the in-memory build does."""
    _, model = saved_and_loaded(hf_llava, tiny_tokenizer_dir, tmp_path / "llava", "llava")
    assert run(model, [0, 2])[0] == [reference(hf_llava, *rows()[i]) for i in (0, 2)]
