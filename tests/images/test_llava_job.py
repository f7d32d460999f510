"""A `batchjob run` job of chat rows with images on a LLaVA folder (issue 34): `image_url` parts by a path relative
to the input file and by a data: URI, two images in one row, a text-only row; each answer equal to transformers'
(its LlavaProcessor's ids and pixel values, generate in fp32); a missing image fails its row alone, naming the
message and the part."""
from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from tests.builders import write_jsonl
from tests.images import job_cases
from tests.images.job_cases import folder_with_tokens

transformers = pytest.importorskip("transformers")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<image>{% else %}{{ p.text }}{% endif %}{% endfor %}"
            "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def png(seed: int, size=(80, 60)) -> bytes:
    return job_cases.png(seed, size)


@pytest.fixture(scope="module")
def llava(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random LLaVA folder (weights drawn so images matter), its tokenizer with <image>, its processor."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    folder = tmp_path_factory.mktemp("llava")
    tok = folder_with_tokens(folder, tiny_tokenizer_dir, ["<image>"])
    image_id = tok.token_to_id("<image>")
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, patch_size=14, image_size=56)
    text = transformers.LlamaConfig(vocab_size=image_id + 1, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim > 1 or "vision_tower" in name or "projector" in name:
                p.normal_(0, 0.2 if ("vision_tower" in name or "projector" in name) else 0.12)
    model.save_pretrained(folder)
    images = CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    images.save_pretrained(folder)
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json")),
        patch_size=14, vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
        chat_template=TEMPLATE)
    return folder, model, processor


def reference(model, processor, content: list, pictures: list[bytes]) -> str:
    """transformers' answer: its processor's ids and pixel values, greedy generate, decoded."""
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    imgs = [Image.open(io.BytesIO(p)) for p in pictures] or None
    inputs = processor(text=text, images=imgs, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_image_rows_of_a_job_answer_as_transformers(tmp_path, llava):
    folder, model, processor = llava
    (tmp_path / "pics").mkdir()
    a, b = png(1), png(2, (50, 90))
    (tmp_path / "pics/a.png").write_bytes(a)
    uri = "data:image/png;base64," + base64.b64encode(b).decode()
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    say = {"type": "text", "text": "what is this"}
    rows = [[part("pics/a.png"), say], [part(uri), say], [part("pics/a.png"), part(uri), say], [say],
            [part("pics/none.png"), say]]
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": c}]} for c in rows])
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", "--model", str(folder), "--input", str(src), "--output", str(out),
                                       "--chat-template", str(tmp_path / "t.jinja"), "--max-tokens", "6",
                                       "--ignore-eos", "--dtype", "float32", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(out).sort_by("row_index").to_pylist()
    want = [reference(model, processor, [{"type": "image"}, {"type": "text", "text": "what is this"}], [a]),
            reference(model, processor, [{"type": "image"}, {"type": "text", "text": "what is this"}], [b]),
            reference(model, processor, [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "what is this"}], [a, b]),
            reference(model, processor, [{"type": "text", "text": "what is this"}], [])]
    assert [r["generated_text"] for r in got[:4]] == want and len(set(want[:3])) == 3
    assert [r["error"] for r in got[:4]] == [None] * 4
    assert got[4]["finish_reason"] == "error" and "message 0: content part 0: pics/none.png: cannot read" in got[4]["error"]
    assert got[0]["prompt_tokens"] > 16  # the image's 16 placeholders are prompt tokens
    limited = tmp_path / "limited"
    result = CliRunner().invoke(main, ["run", "--model", str(folder), "--input", str(src), "--output", str(limited),
                                       "--chat-template", str(tmp_path / "t.jinja"), "--max-tokens", "6", "--ignore-eos",
                                       "--dtype", "float32", "--limit-images-per-prompt", "1", "--no-progress"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    capped = read_results(limited).sort_by("row_index").to_pylist()
    assert [r["generated_text"] for r in capped[:2]] == want[:2]  # rows of one image as before
    assert "message 0: content part 1: more than 1 images (limit_images_per_prompt)" in capped[2]["error"]


def openai_line(i: int, content: list) -> dict:
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                     "ignore_eos": True}}


def test_openai_batch_lines_with_data_uris_and_a_text_only_model_refusing_them(tmp_path, llava, tiny_model_dir):
    folder, model, processor = llava
    a = png(3, (64, 100))
    uri = "data:image/png;base64," + base64.b64encode(a).decode()
    content = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": uri, "detail": "low"}}]
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps(openai_line(0, content)) + "\n" + json.dumps(openai_line(1, content[:1])) + "\n")
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    for name, model_dir in (("llava", folder), ("text", tiny_model_dir("llama"))):
        out = tmp_path / f"out-{name}"
        result = CliRunner().invoke(main, ["run", "--model", str(model_dir), "--input", str(src), "--output", str(out),
                                           "--chat-template", str(tmp_path / "t.jinja"), "--dtype", "float32",
                                           "--no-progress"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        row, text_row = read_results(out).sort_by("row_index").to_pylist()
        assert text_row["error"] is None
        if name == "llava":
            want = reference(model, processor, [{"type": "text", "text": "describe"}, {"type": "image"}], [a])
            assert row["error"] is None and row["generated_text"] == want
        else:
            assert row["finish_reason"] == "error" and "is an image (image_url)" in row["error"]
            assert "is a text-only model" in row["error"]


def test_the_python_api_takes_pil_images_in_a_messages_parts(llava):
    import batchjob

    folder, model, processor = llava
    a = png(5)
    llm = batchjob.LLM(str(folder), dtype="float32", kv_cache_gb=0.05)
    msgs = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(a))},
                                         {"type": "text", "text": "what is this"}]}]
    got = llm.chat([msgs], max_tokens=6, ignore_eos=True, chat_template=TEMPLATE)
    want = reference(model, processor, [{"type": "image"}, {"type": "text", "text": "what is this"}], [a])
    assert got[0].error is None and got[0].text == want


def test_a_llava_folder_without_its_image_processor_settings_is_refused_in_one_line(tmp_path, llava):
    folder, _, _ = llava
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "preprocessor_config.json").unlink()
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "hello"}])
    result = CliRunner().invoke(main, ["run", "--model", str(bare), "--input", str(src), "--output",
                                       str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code != 0 and "preprocessor_config.json: missing" in result.output
    assert "Traceback" not in result.output


def run_job(folder, src, out, *extra):
    return CliRunner().invoke(main, ["run", "--model", str(folder), "--input", str(src), "--output", str(out),
                                     "--max-tokens", "6", "--ignore-eos", "--dtype", "float32", "--no-progress", *extra],
                              catch_exceptions=False)


def test_an_image_column_of_a_datasets_parquet_a_datasets_folder_and_jsonl_paths(tmp_path, llava, tiny_model_dir):
    """--image-column: the row becomes a user message of its images, then its prompt text; the Image column that
    `datasets` writes ({bytes, path} structs) read as it is from its Parquet and its save_to_disk folder; a JSONL
    column of paths relative to the input file (a list: two images); a null: the text alone."""
    datasets = pytest.importorskip("datasets")
    folder, model, processor = llava
    a, b = png(11, (70, 50)), png(12, (40, 96))
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics/a.png").write_bytes(a)
    (tmp_path / "pics/b.png").write_bytes(b)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    template = ["--chat-template", str(tmp_path / "t.jinja")]
    one = lambda text: [{"type": "image"}, {"type": "text", "text": text}]  # noqa: E731
    want = [reference(model, processor, one("caption this"), [a]), reference(model, processor, one("and this"), [b])]
    ds = datasets.Dataset.from_dict({"image": [str(tmp_path / "pics/a.png"), str(tmp_path / "pics/b.png")],
                                     "prompt": ["caption this", "and this"]}).cast_column("image", datasets.Image())
    ds.to_parquet(str(tmp_path / "hf.parquet"))
    ds.save_to_disk(str(tmp_path / "hf-folder"))
    for name in ("hf.parquet", "hf-folder"):
        result = run_job(folder, tmp_path / name, tmp_path / f"out-{name}", "--image-column", "image", *template)
        assert result.exit_code == 0, result.output
        got = read_results(tmp_path / f"out-{name}").sort_by("row_index").to_pylist()
        assert [r["generated_text"] for r in got] == want, name
    src = write_jsonl(tmp_path / "in.jsonl", [{"pics": ["pics/a.png", "pics/b.png"], "prompt": "both"},
                                              {"pics": None, "prompt": "no picture"},
                                              {"pics": "pics/none.png", "prompt": "missing"},
                                              {"pics": ["pics/a.png"], "prompt": "caption this"}])
    result = run_job(folder, src, tmp_path / "out-jsonl", "--image-column", "pics", "--limit-images-per-prompt", "2",
                     *template)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "out-jsonl").sort_by("row_index").to_pylist()
    assert got[0]["generated_text"] == reference(model, processor, [{"type": "image"}, *one("both")], [a, b])
    assert got[1]["generated_text"] == reference(model, processor, [{"type": "text", "text": "no picture"}], [])
    assert got[2]["finish_reason"] == "error" and got[2]["error"].startswith("column 'pics': ")
    assert "pics/none.png: cannot read" in got[2]["error"]
    assert got[3]["generated_text"] == want[0]
    capped = run_job(folder, src, tmp_path / "out-capped", "--image-column", "pics", "--limit-images-per-prompt", "1",
                     *template)
    assert capped.exit_code == 0, capped.output
    rows = read_results(tmp_path / "out-capped").sort_by("row_index").to_pylist()
    assert "column 'pics': 2 images, more than 1 (limit_images_per_prompt)" in rows[0]["error"]
    assert rows[3]["generated_text"] == want[0]
    # a column that is not there, and a text-only model: the job refuses at start, naming the option
    missing = run_job(folder, src, tmp_path / "out-missing", "--image-column", "photo", *template)
    assert missing.exit_code != 0 and "'photo' not found" in missing.output and "--image-column" in missing.output
    text_only = run_job(tiny_model_dir("llama"), src, tmp_path / "out-text", "--image-column", "pics", *template)
    assert text_only.exit_code != 0 and "image_column:" in text_only.output and "text-only model" in text_only.output
    assert not (tmp_path / "out-text" / "manifest.json").exists()


def test_a_messages_row_with_an_image_column_value_fails_alone(tmp_path, llava):
    folder, model, processor = llava
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": "hi"}], "image": "x.png"},
                                              {"messages": [{"role": "user", "content": "hi"}], "image": None}])
    result = run_job(folder, src, tmp_path / "out", "--image-column", "image", "--chat-template", str(tmp_path / "t.jinja"))
    assert result.exit_code == 0, result.output
    bad, good = read_results(tmp_path / "out").sort_by("row_index").to_pylist()
    assert "column 'image': a row with chat messages carries its images in their parts" in bad["error"]
    assert good["error"] is None and good["generated_text"] == reference(model, processor, [{"type": "text", "text": "hi"}], [])


def test_image_rows_killed_with_sigkill_then_rerun_give_every_row_once_with_the_same_text(tmp_path, llava):
    """A job of sampled image rows (paths and data URIs) killed with SIGKILL after its first commit, then run again:
    every row once, each with the text of an uninterrupted run (the images are read again for the rows redone)."""
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from batchjob.io.manifest import Manifest

    folder, _, _ = llava
    (tmp_path / "pics").mkdir()
    pics = [png(20 + k, (40 + 10 * k, 90 - 10 * k)) for k in range(3)]
    for k, data in enumerate(pics):
        (tmp_path / f"pics/{k}.png").write_bytes(data)
    uri = "data:image/png;base64," + base64.b64encode(pics[2]).decode()
    part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": [part(f"pics/{i % 2}.png" if i % 3 else uri),
                                                       {"type": "text", "text": f"row {i}"}]}],
             "temperature": 0.8 if i % 2 else 0.0} for i in range(40)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    common = ["run", "--model", folder, "--input", src, "--chat-template", tmp_path / "t.jinja", "--max-tokens", 16,
              "--ignore-eos", "--seed", 3, "--part-rows", 4, "--part-seconds", 0.2, "--no-progress"]
    repo = Path(__file__).resolve().parents[2]
    # the killed run takes 2 rows a step (rows left when it is killed); the reference and the rerun take many: a
    # row's text does not depend on the rows beside it
    job = lambda out, seqs=16: subprocess.Popen([sys.executable, "-m", "batchjob.cli.main", *map(str, common),  # noqa: E731
                                                 "--max-num-seqs", str(seqs), "--output", str(out)],
                                                cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ref = job(tmp_path / "ref")
    assert ref.wait(timeout=600) == 0, ref.stderr.read()
    out = tmp_path / "out"
    proc, killed = job(out, seqs=2), False
    while proc.poll() is None:
        try:
            manifest = Manifest.load(out)
        except Exception:  # noqa: BLE001 - the reader may race the first commit
            manifest = None
        if manifest is not None and 0 < manifest.done_rows().count() < len(rows):
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = True
            break
        time.sleep(0.01)
    assert killed, "the job finished before it could be killed"
    assert job(out).wait(timeout=600) == 0
    got = read_results(out).sort_by("row_index").to_pylist()
    want = read_results(tmp_path / "ref").sort_by("row_index").to_pylist()
    assert [r["row_index"] for r in got] == list(range(len(rows)))
    assert [r["generated_text"] for r in got] == [r["generated_text"] for r in want]
    assert all(r["error"] is None for r in got)


def test_http_images_of_a_job_from_a_local_server(tmp_path, llava):
    """Rows naming images by http url (chat parts and an image column) answer as the same images by path; a url the
    server does not have fails its row alone, naming it."""
    import http.server
    import threading
    from functools import partial

    folder, model, processor = llava
    (tmp_path / "www").mkdir()
    a = png(31, (70, 44))
    (tmp_path / "www/a.png").write_bytes(a)
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path / "www"))
    handler.log_message = lambda *args, **kw: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        (tmp_path / "t.jinja").write_text(TEMPLATE)
        part = lambda u: {"type": "image_url", "image_url": {"url": u}}  # noqa: E731
        say = {"type": "text", "text": "what is this"}
        src = write_jsonl(tmp_path / "in.jsonl", [{"messages": [{"role": "user", "content": [part(f"{url}/a.png"), say]}]},
                                                  {"messages": [{"role": "user", "content": [part(f"{url}/b.png"), say]}]}])
        result = run_job(folder, src, tmp_path / "out", "--chat-template", str(tmp_path / "t.jinja"))
        assert result.exit_code == 0, result.output
        got, missing = read_results(tmp_path / "out").sort_by("row_index").to_pylist()
        assert got["generated_text"] == reference(model, processor, [{"type": "image"}, say], [a])
        assert missing["finish_reason"] == "error" and f"{url}/b.png: HTTP 404" in missing["error"]
        column = write_jsonl(tmp_path / "col.jsonl", [{"image": f"{url}/a.png", "prompt": "what is this"}])
        result = run_job(folder, column, tmp_path / "col", "--image-column", "image", "--chat-template",
                         str(tmp_path / "t.jinja"))
        assert result.exit_code == 0, result.output
        assert read_results(tmp_path / "col").to_pylist()[0]["generated_text"] == got["generated_text"]
    finally:
        httpd.shutdown()
