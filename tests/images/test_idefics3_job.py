"""A `batchjob run` job of image rows on an Idefics3 (SmolVLM) folder (issue 34): images split into tiles plus the
global image, small ones one tile, two images of different sizes in one row, an image column and chat parts; each
answer equal to transformers' (its Idefics3Processor's ids and pixel values, generate in fp32)."""
from __future__ import annotations

import base64
import io
import json

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchjob.cli.main import main
from batchjob.images.idefics3 import Idefics3Preprocessor
from batchjob.images.layouts import image_settings
from batchjob.io.parts import read_results
from tests.builders import write_jsonl
from tests.images.job_cases import folder_with_tokens, png

transformers = pytest.importorskip("transformers")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random Idefics3 folder: 56 px tiles of 4 placeholders, images up to 112 px (2 x 2 tiles + global)."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    folder = tmp_path_factory.mktemp("smolvlm")
    tok = folder_with_tokens(folder, tiny_tokenizer_dir, SPECIAL)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=14,
                  image_size=56)
    text = dict(vocab_size=tok.get_vocab_size(), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=text, image_token_id=tok.token_to_id("<image>"),
                                      scale_factor=2)
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1 or "vision_model" in name or "connector" in name:
                p.normal_(0, 0.2 if ("vision_model" in name or "connector" in name) else 0.12)
    model.save_pretrained(folder)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    processor = transformers.Idefics3Processor(
        image_processor=images, tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")),
        image_seq_len=4, chat_template=TEMPLATE)
    processor.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # the job is given its template
    return folder, model, processor


def reference(model, processor, content: list, pictures: list[bytes], max_tokens: int = 6) -> str:
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    imgs = [[Image.open(io.BytesIO(p)) for p in pictures]] if pictures else None
    inputs = processor(text=text, images=imgs, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_image_rows_answer_as_transformers(tmp_path, smolvlm):
    folder, model, processor = smolvlm
    wide, tall, small = png(1, (150, 60)), png(2, (40, 130)), png(3, (30, 30))
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
    want = [reference(model, processor, [image, text], [wide]), reference(model, processor, [image, text], [tall]),
            reference(model, processor, [image, image, text], [small, wide]), reference(model, processor, [text], [])]
    assert [r["error"] for r in got] == [None] * 4
    assert [r["generated_text"] for r in got] == want and len(set(want)) == 4
    assert got[0]["prompt_tokens"] > 3 * 4  # 1 x 2 tiles and the global image, 4 placeholders each
    summary = json.loads((tmp_path / "out" / "stats.jsonl").read_text().splitlines()[-1])
    tiles = Idefics3Preprocessor.from_config(image_settings(folder)).tiles
    each = {name: len(tiles(Image.open(io.BytesIO(data)))[0]) for name, data in (("wide", wide), ("tall", tall),
                                                                                   ("small", small))}
    assert each == {"wide": 3, "tall": 3, "small": 5}  # 1 x 2 (+ global), 2 x 1 (+ global), 2 x 2 (+ global)
    # the wide image again in the third row: its 3 tiles come from the encoder cache
    assert summary["images_encoded"] == 3 + 3 + 5 and summary["images_cached"] == 3
    assert 0 < summary["encoder_s"] <= summary["model_s"]
    # an encoder budget of one tile a step: the tiles spread over more steps, the same texts and the same cache reads
    result = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(tmp_path / "one-tile"), *common,
                                       "--max-num-encoder-tokens", "4"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [r["generated_text"] for r in read_results(tmp_path / "one-tile").sort_by("row_index").to_pylist()] == want
    budgeted = json.loads((tmp_path / "one-tile" / "stats.jsonl").read_text().splitlines()[-1])
    assert (budgeted["images_encoded"], budgeted["images_cached"]) == (11, 3)
    assert budgeted["steps"] > summary["steps"], (budgeted["steps"], summary["steps"])
    column = write_jsonl(tmp_path / "col.jsonl", [{"image": "pics/tall.png", "prompt": "what is this"}])
    result = CliRunner().invoke(main, ["run", "--input", str(column), "--output", str(tmp_path / "col"), "--image-column",
                                       "image", *common], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert read_results(tmp_path / "col").to_pylist()[0]["generated_text"] == want[1]


def test_the_caption_example_job_runs_on_a_folder_the_user_brings(tmp_path, smolvlm):
    """jobs/caption.toml with --model naming a folder: its sample pictures captioned, one row each."""
    from pathlib import Path

    folder, model, processor = smolvlm
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    result = CliRunner().invoke(main, ["run", str(root / "jobs/caption.toml"), "--model", str(folder), "--output",
                                       str(tmp_path / "out"), "--chat-template", str(tmp_path / "t.jinja"),
                                       "--max-tokens", "4", "--ignore-eos", "--dtype", "float32", "--no-progress"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = read_results(tmp_path / "out").sort_by("row_index").to_pylist()
    assert [r["id"] for r in rows] == ["p0", "p1", "p2"] and all(r["error"] is None for r in rows)
    picture = (root / "jobs/data/images/sunset.png").read_bytes()
    assert rows[0]["generated_text"] == reference(model, processor, [{"type": "image"}, {"type": "text", "text":
                                                  "Describe this picture in one sentence."}], [picture], max_tokens=4)


def test_questions_about_the_same_pictures_encode_each_tile_once(tmp_path, smolvlm):
    # VQA rows: 16 questions over 2 pictures (2 tiles and the global image each: 3 placeholder runs): whatever the
    # batch and the chunking, each run is encoded once; later rows read the encoder cache or the prefix cache
    folder, model, processor = smolvlm
    (tmp_path / "pics").mkdir()
    for k in range(2):
        (tmp_path / f"pics/{k}.png").write_bytes(png(10 + k, (150, 60)))
    src = write_jsonl(tmp_path / "in.jsonl", [{"image": f"pics/{i % 2}.png", "prompt": f"question {i}: what is this"}
                                              for i in range(16)])
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    texts = []
    for k, extra in enumerate(([], ["--max-num-seqs", "4"], ["--max-num-batched-tokens", "32"],
                               ["--encoder-cache-tokens", "0"])):
        out = tmp_path / f"out{k}"
        result = CliRunner().invoke(main, ["run", "--input", str(src), "--output", str(out), "--image-column", "image",
                                           "--model", str(folder), "--chat-template", str(tmp_path / "t.jinja"),
                                           "--max-tokens", "3", "--ignore-eos", "--dtype", "float32", "--no-progress",
                                           *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        summary = json.loads((out / "stats.jsonl").read_text().splitlines()[-1])
        if extra[:1] != ["--encoder-cache-tokens"]:
            assert summary["images_encoded"] == 2 * 3
        else:  # no encoder cache: a row whose prompt computes a run encodes it again
            assert summary["images_encoded"] > 2 * 3 and summary["images_cached"] == 0
        texts.append(read_results(out).sort_by("row_index").column("generated_text").to_pylist())
    assert all(t == texts[0] for t in texts)
