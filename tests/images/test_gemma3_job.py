"""A `batchjob run` job of image rows on a Gemma 3 folder (issue 34): the folder as transformers saves it (model,
Gemma3Processor with its image processor, a tokenizer with `<start_of_image>`, `<image_soft_token>`,
`<end_of_image>`); the prompt's ids and the pixel values equal Gemma3Processor's (its blank lines around each image
merge with the template's newlines: written into the text before tokenizing), and each answer equals transformers'
generate (fp32, the image runs attending both ways) for rows of one image, two images, none, by path and data URI,
and through an image column; a bf16 job's sampled rows alone equal batched."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchjob.cli.main import main
from batchjob.images.layouts import image_settings, layout_for
from batchjob.io.parts import read_results
from batchjob.models.loader import load_model
from tests.builders import write_jsonl
from tests.images.job_cases import folder_with_tokens, png

transformers = pytest.importorskip("transformers")
# Gemma 3's chat template, cut to what these rows use: the turns, a trimmed text part, an image part as <start_of_image>
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
            "{% if m.content is string %}{{ m.content | trim }}{% else %}{% for p in m.content %}"
            "{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text | trim }}{% endif %}"
            "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SPECIAL = ["<start_of_image>", "<end_of_image>", "<image_soft_token>", "<start_of_turn>", "<end_of_turn>"]
SIDE, RUN = 112, 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tiny_tokenizer_dir):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder = tmp_path_factory.mktemp("gemma3")
    tok = folder_with_tokens(folder, tiny_tokenizer_dir, SPECIAL)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                sliding_window=12, layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                  image_size=SIDE)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=RUN,
                                    boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                                    image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(3)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # weights that make images matter (default init: flat)
            vision_part = "vision_tower" in name or "multi_modal" in name
            if p.ndim > 1 or vision_part:
                p.normal_(0, 0.2 if vision_part else 0.02)
    model.save_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|endoftext|>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    images = Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE})
    processor = transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=RUN)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder, model, processor


def prompt(content: list) -> str:
    """The rendered template of one user turn (`{{ bos_token }}` is the tiny tokenizer's <|endoftext|>)."""
    body = "".join("<start_of_image>" if p["type"] == "image" else p["text"].strip() for p in content)
    return f"<|endoftext|><start_of_turn>user\n{body}<end_of_turn>\n<start_of_turn>model\n"


def reference(gemma3, content: list, pictures: list[bytes]) -> tuple[list[int], str]:
    """transformers' prompt ids and answer: Gemma3Processor on the rendered text and the images, greedy generate."""
    _, model, processor = gemma3
    images = [Image.open(io.BytesIO(p)) for p in pictures] or None
    inputs = processor(text=prompt(content), images=images, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = inputs["input_ids"][0].tolist()
    return ids, processor.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_pixel_values_and_prompt_ids_are_gemma3_processors(gemma3):
    folder, _, processor = gemma3
    loaded = load_model(str(folder), dtype=torch.float32)
    layout = layout_for(loaded.config.architecture, loaded.config.extra, folder, image_settings(folder), loaded.tokenizer)
    for seed, size in ((1, (150, 60)), (2, (50, 130)), (3, (SIDE, SIDE)), (4, (301, 199))):
        img = Image.open(io.BytesIO(png(seed, size)))
        want = processor.image_processor(images=[img], return_tensors="np")["pixel_values"][0]
        placed, runs = layout.place(img)
        assert len(runs) == 1 and runs[0][:2] == (1, RUN) and np.array_equal(runs[0][2], want)
    content = [{"type": "image"}, {"type": "text", "text": "what is this"}]
    img = Image.open(io.BytesIO(png(1, (150, 60))))
    want = processor(text=prompt(content), images=[img], add_special_tokens=False)["input_ids"][0]
    rendered = layout.template_text(prompt(content))
    ids = loaded.tokenizer.encode(rendered, add_special_tokens=False)
    at = ids.index(layout.image_token_id)
    assert ids[:at] + layout.place(img)[0] + ids[at + 1:] == want
    assert loaded.tokenizer.encode(prompt(content), add_special_tokens=False)[:at] != want[:at]  # the merge matters


def test_image_rows_answer_as_transformers(tmp_path, gemma3):
    folder = gemma3[0]
    wide, tall = png(1, (150, 60)), png(2, (50, 130))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics/wide.png").write_bytes(wide)
    uri = "data:image/png;base64," + base64.b64encode(tall).decode()
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    say = {"type": "text", "text": "what is this"}
    chats = [[part("pics/wide.png"), say], [part(uri), say], [part(uri), part("pics/wide.png"), say], [say]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": c}]} for c in chats])
    common = ["--model", str(folder), "--max-tokens", "6", "--ignore-eos", "--dtype", "float32", "--no-progress"]
    result = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / "out"), *common],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "out").sort_by("row_index").to_pylist()
    image, text = {"type": "image"}, {"type": "text", "text": "what is this"}
    want = [reference(gemma3, [image, text], [wide])[1], reference(gemma3, [image, text], [tall])[1],
            reference(gemma3, [image, image, text], [tall, wide])[1], reference(gemma3, [text], [])[1]]
    assert [r["error"] for r in got] == [None] * 4
    assert [r["generated_text"] for r in got] == want
    assert want[0] != want[1] != want[3]  # another image, no image: other answers
    column = write_jsonl(tmp_path / "col.jsonl", [{"image": "pics/wide.png", "prompt": "what is this"}])
    result = CliRunner().invoke(main, ["run", "--input", str(column), "--output", str(tmp_path / "col"), "--image-column",
                                       "image", *common], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert read_results(tmp_path / "col").to_pylist()[0]["generated_text"] == want[0]


def test_a_bf16_jobs_sampled_rows_alone_equal_batched(tmp_path, gemma3):
    folder = gemma3[0]
    (tmp_path / "a.png").write_bytes(png(1, (150, 60)))
    (tmp_path / "b.png").write_bytes(png(2, (50, 130)))
    rows = [{"image": ["a.png", "b.png", None][i % 3], "prompt": f"what is this {i}"} for i in range(6)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = ["--model", str(folder), "--max-tokens", "8", "--temperature", "0.9", "--seed", "3", "--dtype", "bfloat16",
              "--image-column", "image", "--no-progress", "--ignore-eos"]
    texts = []
    for name, extra in (("batched", []), ("alone", ["--max-num-seqs", "1"])):
        result = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / name), *common, *extra],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        texts.append([r["generated_text"] for r in read_results(tmp_path / name).sort_by("row_index").to_pylist()])
    assert texts[0] == texts[1] and len(set(texts[0])) > 1
