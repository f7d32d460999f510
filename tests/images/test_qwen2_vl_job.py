"""A `batchjob run` job of image rows on a Qwen2-VL folder (issue 34): images of different sizes and aspect ratios
(dynamic resolution: each its own patch grid), two in one row, by path and data URI, and an image column; each answer
equal to transformers' (its Qwen2-VL image processor's pixel values and grid, the prompt expanded as its processor
does, generate in fp32 with M-RoPE)."""
from __future__ import annotations

import base64
import io

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from tests.builders import write_jsonl
from tests.images.job_cases import folder_with_tokens, png

transformers = pytest.importorskip("transformers")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}"
            "{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
IMAGES = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 24)  # 4 to 24 merged blocks an image: a fast test


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory, tiny_tokenizer_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    folder = tmp_path_factory.mktemp("qwen2vl")
    tok = folder_with_tokens(folder, tiny_tokenizer_dir, SPECIAL)
    vision = dict(depth=2, embed_dim=32, hidden_size=48, num_heads=4, mlp_ratio=2, hidden_act="quick_gelu",
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]})
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    cfg = transformers.Qwen2VLConfig(vision_config=vision, text_config=text, image_token_id=ids["<|image_pad|>"],
                                     video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                                     vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1 or "visual" in name:
                p.normal_(0, 0.2 if "visual" in name else 0.12)
    model.save_pretrained(folder)
    processor = Qwen2VLImageProcessorPil(**IMAGES)
    processor.save_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    return folder, model, processor, tokenizer


def reference(qwen2_vl, content: list, pictures: list[bytes]) -> str:
    """transformers' answer: its image processor's patches and grids, each image's pad token repeated as its
    processor does (grid t * h * w / 4), greedy generate with M-RoPE."""
    _, model, processor, tokenizer = qwen2_vl
    text = "<|im_start|>user\n" + "".join("<|vision_start|><|image_pad|><|vision_end|>" if p["type"] == "image"
                                          else p["text"] for p in content) + "<|im_end|>\n<|im_start|>assistant\n"
    kw = {}
    if pictures:
        out = processor(images=[Image.open(io.BytesIO(p)) for p in pictures], return_tensors="pt")
        for t, h, w in out["image_grid_thw"].tolist():
            text = text.replace("<|image_pad|>", "<|placeholder|>" * (t * h * w // 4), 1)
        text = text.replace("<|placeholder|>", "<|image_pad|>")
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    if pictures:
        kw["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0, **kw)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_image_rows_answer_as_transformers(tmp_path, qwen2_vl):
    folder = qwen2_vl[0]
    wide, tall, small = png(1, (150, 60)), png(2, (50, 130)), png(3, (30, 30))
    (tmp_path / "pics").mkdir()
    for name, data in (("wide", wide), ("tall", tall), ("small", small)):
        (tmp_path / f"pics/{name}.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(tall).decode()
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    say = {"type": "text", "text": "what is this"}
    chats = [[part("pics/wide.png"), say], [part(uri), say], [part("pics/small.png"), part("pics/wide.png"), say], [say]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": c}]} for c in chats])
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    common = ["--model", str(folder), "--chat-template", str(tmp_path / "t.jinja"), "--max-tokens", "6", "--ignore-eos",
              "--dtype", "float32", "--no-progress"]
    result = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / "out"), *common],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "out").sort_by("row_index").to_pylist()
    image, text = {"type": "image"}, {"type": "text", "text": "what is this"}
    want = [reference(qwen2_vl, [image, text], [wide]), reference(qwen2_vl, [image, text], [tall]),
            reference(qwen2_vl, [image, image, text], [small, wide]), reference(qwen2_vl, [text], [])]
    assert [r["error"] for r in got] == [None] * 4
    assert [r["generated_text"] for r in got] == want and len(set(want)) == 4
    column = write_jsonl(tmp_path / "col.jsonl", [{"image": "pics/tall.png", "prompt": "what is this"}])
    result = CliRunner().invoke(main, ["run", "--input", str(column), "--output", str(tmp_path / "col"), "--image-column",
                                       "image", *common], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert read_results(tmp_path / "col").to_pylist()[0]["generated_text"] == want[1]
