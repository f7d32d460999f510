"""LoRA adapters in a job (issue 37): `--lora NAME=PATH,...` (or `[lora] adapters`) and a `lora` column naming each
row's adapter give transformers + PEFT's greedy text per row, the base where the column is null; an OpenAI Batch body's
`model` naming an adapter picks it; a row naming an unknown adapter fails alone; SIGKILL and resume give the same
text; and each adapter PEFT feature batchjob does not apply is refused at start, naming the adapter and the field."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.manifest import Manifest
from batchjob.io.parts import read_results
from tests.builders import write_jsonl
from tests.job.test_resume import start_job, wait_for_parts
from tests.lora.test_lora_engine import ADAPTERS, make_base, reference, save_adapters

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama folder (the tiny tokenizer's 400 tokens) and its three adapters."""
    root = tmp_path_factory.mktemp("lora")
    base = make_base("llama")
    base.save_pretrained(root / "base")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_tokenizer_dir / f, root / "base" / f)
    return base, root / "base", save_adapters(base, root)


def lora_flag(paths) -> str:
    return ",".join(f"a{k}={p}" for k, p in enumerate(paths))


PROMPTS = [[5, 17, 33, 80, 2, 9], [7, 7, 21, 40], [11, 12, 13, 14, 15], [3, 99, 4]]


def test_rows_of_each_adapter_and_the_base_give_peft_text(tmp_path, folders):
    base, model, paths = folders
    rows = [{"prompt": PROMPTS[i % 4], "lora": [None, "a0", "a1", "a2"][i % 4]} for i in range(8)]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "o"),
                                       "--lora", lora_flag(paths), "--max-tokens", "8", "--ignore-eos", "--dtype",
                                       "float32", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "o").sort_by("row_index").to_pylist()
    for i, row in enumerate(got):
        slot = i % 4 - 1
        assert row["error"] is None
        want = reference(base, None if slot < 0 else paths[slot], PROMPTS[i % 4])
        assert row["generated_text"] == decode(model, want)


def decode(model, ids) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json")).decode(ids, skip_special_tokens=True)


def test_openai_model_names_an_adapter_and_an_unknown_adapter_fails_its_row(tmp_path, folders):
    base, model, paths = folders
    job = tmp_path / "job.toml"
    job.write_text(f'[lora]\nadapters = {{a0 = "{paths[0]}", a1 = "{paths[1]}"}}\n')
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0], "lora": "a1"}, {"prompt": PROMPTS[0], "lora": "nope"},
                                              {"prompt": PROMPTS[0]}])
    result = CliRunner().invoke(main, ["run", str(job), "--model", str(model), "--input", str(src), "--output",
                                       str(tmp_path / "o"), "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
                                       "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "o").sort_by("row_index").to_pylist()
    assert "'nope' is not one of the job's LoRA adapters (a0, a1)" in got[1]["error"]
    assert got[0]["generated_text"] != got[2]["generated_text"]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": name, "prompt": PROMPTS[0], "max_tokens": 8}} for i, name in enumerate(["a1", "base"])]
    batch = write_jsonl(tmp_path / "batch.jsonl", lines)
    result = CliRunner().invoke(main, ["run", str(job), "--model", str(model), "--input", str(batch), "--output",
                                       str(tmp_path / "b"), "--ignore-eos", "--dtype", "float32", "--no-progress"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    by_id = {r["custom_id"]: r for r in read_results(tmp_path / "b").to_pylist()}
    assert by_id["r0"]["generated_text"] == got[0]["generated_text"] and by_id["r1"]["generated_text"] == got[2]["generated_text"]


def test_a_lora_job_resumes_after_sigkill_with_identical_text(tmp_path, folders):
    _, model, paths = folders
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[i % 4] * 3, "lora": [None, "a0", "a1", "a2"][i % 4]}
                                              for i in range(400)])
    args = ["--model", model, "--input", src, "--lora", lora_flag(paths), "--max-tokens", 12, "--ignore-eos",
            "--temperature", 0.8, "--seed", 1, "--part-rows", 8, "--no-progress"]
    # the killed run takes 4 rows a step (rows left when it is killed); the reference and the rerun take many: a row's
    # text does not depend on the rows beside it, adapters or not (tests/lora/test_lora_engine.py)
    many = ["run", *map(str, args), "--max-num-seqs", "32"]
    ref = CliRunner().invoke(main, [*many, "--output", str(tmp_path / "ref")], catch_exceptions=False)
    assert ref.exit_code == 0, ref.output
    out = tmp_path / "out"
    proc = start_job(*args, "--max-num-seqs", 4, "--output", out)
    wait_for_parts(out, proc, parts=1)
    proc.kill()
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 400
    again = CliRunner().invoke(main, [*many, "--output", str(out)], catch_exceptions=False)
    assert again.exit_code == 0, again.output
    texts = lambda d: read_results(d).sort_by("row_index").column("generated_text").to_pylist()  # noqa: E731
    assert texts(out) == texts(tmp_path / "ref")


def broken(path, tmp_path, name, change):
    dst = tmp_path / name
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    change(cfg, dst)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _other_base(cfg, dst):
    from safetensors.torch import load_file, save_file

    w = load_file(str(dst / "adapter_model.safetensors"))
    save_file({k: torch.zeros(v.shape[0], 32) if "lora_A" in k else v for k, v in w.items()},
              str(dst / "adapter_model.safetensors"))


@pytest.mark.parametrize("name, change, says", [
    ("dora", lambda c, d: c.update(use_dora=True), "use_dora = true: DoRA is not supported"),
    ("save", lambda c, d: c.update(modules_to_save=["lm_head"]), "modules_to_save"),
    ("bias", lambda c, d: c.update(bias="all"), "bias = \"all\": LoRA biases is not supported"),
    ("embed", lambda c, d: c.update(target_modules=["embed_tokens", "q_proj"]), "targets embeddings or the LM head"),
    ("rank", lambda c, d: None, "r = 4 is over --max-lora-rank 2"),
    ("other", _other_base, "do not fit the base model's 64 -> 64 projection (another base model?)"),
])
def test_what_is_not_applied_is_refused_at_start_naming_the_adapter_and_field(tmp_path, folders, name, change, says):
    _, model, paths = folders
    adapter = broken(paths[0], tmp_path, name, change)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0]}])
    extra = ["--max-lora-rank", "2"] if name == "rank" else []
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "o"),
                                       "--lora", f"bad={adapter}", "--no-progress", *extra])
    assert result.exit_code != 0 and says in result.output and "lora 'bad'" in result.output, result.output


def test_the_example_job_runs_with_the_adapter_its_script_writes(tmp_path, smollm2_gguf_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    made = subprocess.run([sys.executable, str(repo / "jobs/data/make_lora_adapter.py"), str(tmp_path / "demo")],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    result = CliRunner().invoke(main, ["run", str(repo / "jobs/lora.toml"), "--lora", f"demo={tmp_path / 'demo'}",
                                       "--input", str(repo / "jobs/data/lora.jsonl"), "--output", str(tmp_path / "o"),
                                       "--max-tokens", "12", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = read_results(tmp_path / "o").sort_by("row_index").to_pylist()
    assert [r["error"] for r in rows] == [None] * 4 and rows[0]["generated_text"] != rows[1]["generated_text"]


def test_a_repeated_lora_flag_adds_adapters_as_repeated_lora_modules_do_in_vllm(tmp_path, folders):
    base, model, paths = folders
    rows = [{"prompt": PROMPTS[i], "lora": name} for i, name in enumerate(["a0", "a1", "a2", None])]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = [x for k, p in enumerate(paths) for x in ("--lora", f"a{k}={p}")]  # one use per adapter
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "o"),
                                       *flags, "--max-tokens", "8", "--ignore-eos", "--dtype", "float32",
                                       "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    got = read_results(tmp_path / "o").sort_by("row_index").to_pylist()
    assert [r["error"] for r in got] == [None] * 4
    assert [r["generated_text"] for r in got] == [decode(model, reference(base, p, PROMPTS[i]))
                                                  for i, p in enumerate([*paths, None])]
    twice = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "t"),
                                      "--lora", f"a0={paths[0]}", "--lora", f"a0={paths[1]}", "--no-progress"])
    assert twice.exit_code == 2 and f"lora: adapter 'a0' is given twice, as {paths[0]} and {paths[1]}" in twice.output


def test_a_missing_adapter_folder_is_described_as_an_adapter_not_a_model(tmp_path, folders):
    _, model, paths = folders
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0]}])
    (tmp_path / "weights.bin").write_bytes(b"x")
    for path, says in ((tmp_path / "nothing", "no such folder"), (tmp_path / "weights.bin", "a file, not a folder"),
                       ("someone/no-such-adapter", "no such folder, nor in the local Hugging Face cache")):
        result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output",
                                           str(tmp_path / "o"), "--lora", f"gone={path}", "--no-progress"])
        assert result.exit_code != 0 and f"lora 'gone': {path}: {says}" in result.output, result.output
        assert "an adapter is a PEFT folder holding adapter_config.json and adapter_model.safetensors" in result.output
        assert "config.json, a .gguf" not in result.output and "Traceback" not in result.output


def test_an_adapter_in_the_local_hugging_face_cache_is_found_by_its_id(tmp_path, folders, monkeypatch):
    """A snapshot of an adapter holds adapter_config.json, not a model's config.json: it is found all the same."""
    base, model, paths = folders
    snapshot = tmp_path / "hub" / "models--me--adapter" / "snapshots" / "0123456789abcdef"
    shutil.copytree(paths[1], snapshot)
    (tmp_path / "hub" / "models--me--adapter" / "refs").mkdir()
    (tmp_path / "hub" / "models--me--adapter" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": PROMPTS[0], "lora": "cached"}])
    result = CliRunner().invoke(main, ["run", "--model", str(model), "--input", str(src), "--output", str(tmp_path / "o"),
                                       "--lora", "cached=me/adapter", "--max-tokens", "8", "--ignore-eos", "--dtype",
                                       "float32", "--no-progress"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    row, = read_results(tmp_path / "o").to_pylist()
    assert row["error"] is None and row["generated_text"] == decode(model, reference(base, paths[1], PROMPTS[0]))


def test_the_python_api_runs_each_prompts_adapter_as_peft_does(folders):
    """LLM(adapters={...}) and generate(..., lora=NAME) (a prompt dict's own `lora` wins): PEFT's greedy text."""
    import batchjob

    base, model, paths = folders
    llm = batchjob.LLM(str(model), adapters={"a0": str(paths[0]), "a1": str(paths[1])}, dtype="float32")
    prompts = [{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": PROMPTS[1], "lora": "a1"}]
    got = llm.generate(prompts, lora="a0", max_tokens=8, ignore_eos=True)
    assert [r.text for r in got] == [decode(model, reference(base, paths[0], PROMPTS[0])),
                                     decode(model, reference(base, paths[1], PROMPTS[1]))]
    plain = llm.generate([{"prompt_token_ids": PROMPTS[2]}], max_tokens=8, ignore_eos=True)
    assert plain[0].text == decode(model, reference(base, None, PROMPTS[2]))
