"""Reasoning models (issue 36): `--reasoning-parser` splits each answer's thinking into the `reasoning` column (and
`reasoning_tokens`), `generated_text` keeps the answer alone; `chat_template_kwargs` per job and per row reach the
template (`enable_thinking: false`); OpenAI Batch output carries `reasoning_content` and `reasoning_tokens`. On a tiny
random Qwen3 model whose tokenizer has `<think>` and `</think>`, with the real templates' generation prompts: Qwen3's
(hybrid: the model opens `<think>` itself, or the template closes it when thinking is off), a Qwen3 thinking
release's and DeepSeek-R1's (the template opens `<think>`). The parsers on recorded outputs: tests/reasoning/."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.io.parts import read_results
from tests.builders import write_jsonl
from tests.conftest import _hf_model

pytest.importorskip("transformers")

TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
QWEN3 = TURNS + ("{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                 "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QWEN3_THINKING = TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
R1 = ("{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random Qwen3 folder whose vocabulary has <think> and </think> (added tokens, not special: the text
    keeps them, as Qwen3's tokenizer does)."""
    from tokenizers import AddedToken, Tokenizer

    folder = tmp_path_factory.mktemp("thinker")
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.add_special_tokens(["<｜User｜>", "<｜Assistant｜>"])
    tok.save(str(folder / "tokenizer.json"))
    _hf_model("qwen3", tok.get_vocab_size(), False).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    return folder


def run(tmp_path, folder, rows, *args, name="out"):
    src = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    result = CliRunner().invoke(main, ["run", "--model", str(folder), "--input", str(src), "--output",
                                       str(tmp_path / name), "--max-tokens", "12", "--ignore-eos", "--no-progress",
                                       "--dtype", "float32", *map(str, args)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result, read_results(tmp_path / name).sort_by("row_index").to_pylist()


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


def test_a_template_that_opens_thinking_gives_rows_all_thinking_until_max_tokens(tmp_path, thinker):
    for template, parser in ((QWEN3_THINKING, "qwen3"), (R1, "deepseek_r1")):
        (tmp_path / "t.jinja").write_text(template)
        result, got = run(tmp_path, thinker, [chat("hello"), chat("what is it")], "--chat-template",
                          tmp_path / "t.jinja", "--reasoning-parser", "auto", name=parser)
        assert f"reasoning parser: {parser} (auto)" in result.output
        for row in got:  # a random model never closes it: max_tokens cuts the thinking
            assert row["generated_text"] == "" and row["reasoning"] and row["reasoning_tokens"] == 12


def test_enable_thinking_false_per_row_and_per_job_gives_no_reasoning(tmp_path, thinker):
    (tmp_path / "t.jinja").write_text(QWEN3)
    rows = [chat("hello", chat_template_kwargs={"enable_thinking": False}), chat("hello")]
    _, got = run(tmp_path, thinker, rows, "--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "qwen3")
    assert got[0]["reasoning"] is None and got[0]["reasoning_tokens"] == 0 and got[0]["generated_text"]
    assert got[0]["prompt_tokens"] > got[1]["prompt_tokens"]  # the template closed the thinking in the prompt
    _, off = run(tmp_path, thinker, [chat("hello")], "--chat-template", tmp_path / "t.jinja", "--reasoning-parser",
                 "qwen3", "--chat-template-kwargs", '{"enable_thinking": false}', name="job")
    assert off[0]["prompt_tokens"] == got[0]["prompt_tokens"] and off[0]["generated_text"] == got[0]["generated_text"]


def test_the_openai_batch_output_has_reasoning_content_and_reasoning_tokens(tmp_path, thinker):
    (tmp_path / "t.jinja").write_text(QWEN3_THINKING)
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}
    src = write_jsonl(tmp_path / "batch.jsonl", [{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                                  "body": {**body, "chat_template_kwargs": {"enable_thinking": True}}}])
    result = CliRunner().invoke(main, ["run", "--model", str(thinker), "--input", str(src), "--output", str(tmp_path / "o"),
                                       "--chat-template", str(tmp_path / "t.jinja"), "--reasoning-parser", "qwen3",
                                       "--ignore-eos", "--no-progress", "--output-format", "openai-batch"],
                                catch_exceptions=False)
    out = tmp_path / "o" / "results.jsonl"
    assert result.exit_code == 0, result.output
    line = json.loads(out.read_text().splitlines()[0])["response"]["body"]
    assert line["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5
    message = line["choices"][0]["message"]
    assert message["content"] == "" and message["reasoning_content"]


@pytest.mark.parametrize("args, says", [
    (["--reasoning-parser", "qwen4"], "reasoning_parser 'qwen4' is unknown; choices: auto, qwen3, deepseek_r1, gpt_oss"),
    (["--reasoning-parser", "gpt_oss"], "has no <|start|> token, so it does not write harmony channels"),
    (["--chat-template-kwargs", "{nope"], "chat_template_kwargs: invalid JSON"),
    (["--chat-template-kwargs", '{"add_generation_prompt": false}'], "is set by batchjob for every row"),
])
def test_bad_options_are_refused_at_start_in_one_line(tmp_path, thinker, args, says):
    src = write_jsonl(tmp_path / "in.jsonl", [chat("hello")])
    result = CliRunner().invoke(main, ["run", "--model", str(thinker), "--input", str(src), "--output",
                                       str(tmp_path / "o"), *args])
    assert result.exit_code != 0 and says in result.output


def test_a_model_without_think_tokens_refuses_a_named_parser_and_auto_finds_none(tmp_path, tiny_model_dir):
    model = tiny_model_dir("qwen3")
    src = write_jsonl(tmp_path / "in.jsonl", [chat("hello")])
    common = ["run", "--model", str(model), "--input", str(src), "--max-tokens", "3", "--no-progress", "--ignore-eos"]
    result = CliRunner().invoke(main, [*common, "--output", str(tmp_path / "a"), "--reasoning-parser", "deepseek_r1"])
    assert result.exit_code != 0 and "has no <think> and </think> tokens" in result.output
    result = CliRunner().invoke(main, [*common, "--output", str(tmp_path / "b"), "--reasoning-parser", "auto"])
    assert result.exit_code == 0 and "reasoning parser: none (auto)" in result.output
    row = read_results(tmp_path / "b").to_pylist()[0]
    assert row["reasoning"] is None and row["generated_text"]


def test_a_row_with_bad_template_kwargs_fails_alone(tmp_path, thinker):
    (tmp_path / "t.jinja").write_text(QWEN3)
    _, got = run(tmp_path, thinker, [chat("hello", chat_template_kwargs=[1]), chat("hello")], "--chat-template",
                 tmp_path / "t.jinja")
    assert "column 'chat_template_kwargs': expected an object" in got[0]["error"] and got[1]["error"] is None


@pytest.mark.parametrize("template", [QWEN3_THINKING, R1], ids=["qwen3-thinking", "deepseek-r1"])
def test_a_thinking_budget_closes_the_thinking_and_the_row_answers(tmp_path, thinker, template):
    """A random model never closes its thinking: the budget does, at most 8 tokens in, then it answers."""
    (tmp_path / "t.jinja").write_text(template)
    rows = [chat(f"question {i}") for i in range(6)] + [chat("q", max_reasoning_tokens=3)]
    _, got = run(tmp_path, thinker, rows, "--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "auto",
                 "--max-reasoning-tokens", 8, "--max-tokens", 24)
    for row in got:
        budget = 3 if row is got[-1] else 8
        assert row["error"] is None and 1 <= row["reasoning_tokens"] <= budget, row
        assert row["reasoning"] and row["generated_text"] and "think>" not in row["generated_text"]
        assert row["completion_tokens"] > row["reasoning_tokens"] + 3  # thought, closed it (</think> and a blank line), answered


def test_a_budgeted_job_is_the_same_alone_batched_and_after_sigkill(tmp_path, thinker):
    from batchjob.io.manifest import Manifest
    from tests.job.test_resume import start_job, wait_for_parts

    (tmp_path / "t.jinja").write_text(QWEN3_THINKING)
    src = write_jsonl(tmp_path / "in.jsonl", [chat(f"question number {i}") for i in range(400)])
    args = ["--model", thinker, "--input", src, "--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "qwen3",
            "--max-reasoning-tokens", 6, "--max-tokens", 16, "--temperature", 0.9, "--seed", 5, "--part-rows", 8,
            "--no-progress", "--dtype", "float32"]
    texts = {}
    # one row a step on the first 100 rows (their row indices, so their seeds, are the batched run's): the other 300
    # would only repeat the comparison, one step a token (about 20 s here)
    for name, extra in (("batched", []), ("alone", ["--max-num-seqs", 1, "--limit", 100])):
        result = CliRunner().invoke(main, ["run", *map(str, args), "--output", str(tmp_path / name), *map(str, extra)],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        rows = read_results(tmp_path / name).sort_by("row_index").to_pylist()
        texts[name] = [(r["reasoning"], r["generated_text"]) for r in rows]
    assert len(texts["alone"]) == 100 and texts["batched"][:100] == texts["alone"]
    assert len(set(texts["batched"])) > 300
    out = tmp_path / "killed"
    proc = start_job(*args, "--output", out, "--max-num-seqs", 4)
    wait_for_parts(out, proc, parts=1)
    proc.kill()
    proc.communicate(timeout=600)
    assert 0 < Manifest.load(out).done_rows().count() < 400
    result = CliRunner().invoke(main, ["run", *map(str, args), "--output", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = read_results(out).sort_by("row_index").to_pylist()
    assert [(r["reasoning"], r["generated_text"]) for r in rows] == texts["batched"]


def test_a_budgeted_job_with_speculative_decoding_and_preemption_gives_the_same_text(tmp_path, thinker):
    """Prompt-lookup proposals are verified through the budget's grammar token by token (llguidance's
    validate_tokens does not count a rule's max_tokens); a KV cache too small for every row preempts rows."""
    (tmp_path / "t.jinja").write_text(QWEN3_THINKING)
    rows = [chat("one two one two one two " * (1 + i % 3)) for i in range(24)]
    common = ["--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "qwen3", "--max-reasoning-tokens", 6,
              "--max-tokens", 20]
    _, plain = run(tmp_path, thinker, rows, *common, name="plain")
    _, spec = run(tmp_path, thinker, rows, *common, "--speculative", "ngram", "--num-speculative-tokens", 3, name="spec")
    _, tight = run(tmp_path, thinker, rows, *common, "--kv-cache-gb", "0.0002", name="tight")
    stats = [json.loads(x) for x in (tmp_path / "tight" / "stats.jsonl").read_text().splitlines()]
    assert max(s.get("preempted_total", 0) for s in stats) > 0, stats[-1]
    want = [(r["reasoning"], r["generated_text"]) for r in plain]
    assert [(r["reasoning"], r["generated_text"]) for r in spec] == want
    assert [(r["reasoning"], r["generated_text"]) for r in tight] == want
    assert all(r["reasoning_tokens"] <= 6 and r["generated_text"] for r in plain)


HARMONY = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
           "<|message|>{{ m.content }}<|end|>{% endfor %}"
           "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random Qwen3 folder whose vocabulary has gpt-oss's harmony tokens (special, as in o200k_harmony)."""
    from tokenizers import Tokenizer

    folder = tmp_path_factory.mktemp("harmony")
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"])
    tok.save(str(folder / "tokenizer.json"))
    _hf_model("qwen3", tok.get_vocab_size(), False).save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}))
    (folder / "chat_template.jinja").write_text(HARMONY)
    return folder


def test_gpt_oss_channels_with_a_budget(tmp_path, harmony_model):
    """The harmony grammar: a channel first (analysis, or final at once); analysis at most 6 tokens, then the
    final channel's answer; `auto` finds gpt_oss from the template."""
    rows = [chat(f"question {i}") for i in range(8)]
    result, got = run(tmp_path, harmony_model, rows, "--reasoning-parser", "auto", "--max-reasoning-tokens", 6,
                      "--max-tokens", 24, "--temperature", 1.0, "--seed", 3)
    assert "reasoning parser: gpt_oss (auto)" in result.output
    for row in got:
        assert row["error"] is None and row["reasoning_tokens"] <= 6
        assert (row["reasoning"] is None) == (row["reasoning_tokens"] == 0)
    assert any(r["reasoning"] for r in got)


@pytest.mark.parametrize("template", [QWEN3_THINKING, R1], ids=["qwen3-thinking", "deepseek-r1"])
def test_a_thinking_budget_of_n_gives_exactly_n_reasoning_tokens(tmp_path, thinker, template):
    """A random model never closes its thinking by itself: the budget closes it after exactly N tokens, as
    `reasoning_tokens` counts them (the tokens between the tags), for each N."""
    (tmp_path / "t.jinja").write_text(template)
    budgets = (1, 2, 4, 6, 8)
    rows = [chat(f"question {i}", max_reasoning_tokens=n) for i, n in enumerate(budgets)]
    _, got = run(tmp_path, thinker, rows, "--chat-template", tmp_path / "t.jinja", "--reasoning-parser", "auto",
                 "--max-tokens", 24)
    assert [r["reasoning_tokens"] for r in got] == list(budgets), got


def test_plain_prompts_say_no_template_is_applied_and_a_rows_template_kwargs_fail_it(tmp_path, thinker):
    """vLLM's generate() applies no chat template and takes no chat_template_kwargs: a plain prompt's kwargs (valid or
    not) fail its row, the job's stop the job at start, and the start line says the parser reads plain prompts."""
    rows = [{"prompt": "hello", "chat_template_kwargs": {"enable_thinking": False}},
            {"prompt": "hello", "chat_template_kwargs": [1]}, {"prompt": "hello"}]
    result, got = run(tmp_path, thinker, rows, "--reasoning-parser", "qwen3")
    assert ("; reasoning parser: qwen3 (plain prompts: no chat template is applied; the model thinks where a prompt "
            "asks it to)") in result.output
    for row in got[:2]:
        assert row["error"] == ("column 'chat_template_kwargs': this row is a plain prompt, which no chat template "
                                "renders, so its variables would be ignored; give the row as messages (or run the job "
                                "with --chat)")
    assert got[2]["error"] is None
    src = write_jsonl(tmp_path / "job.jsonl", [{"prompt": "hello"}])
    stopped = CliRunner().invoke(main, ["run", "--model", str(thinker), "--input", str(src), "--output",
                                        str(tmp_path / "job"), "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert stopped.exit_code != 0 and "chat_template_kwargs: the rows are plain prompts" in stopped.output
    (tmp_path / "t.jinja").write_text(QWEN3)
    result, chatted = run(tmp_path, thinker, rows, "--chat", "--chat-template", tmp_path / "t.jinja",
                          "--reasoning-parser", "qwen3", name="chat")
    assert "; reasoning parser: qwen3\n" in result.output  # --chat: the template applies, nothing to say
    assert chatted[0]["error"] is None and chatted[0]["prompt_tokens"] > chatted[2]["prompt_tokens"]  # thinking off
    assert "expected an object" in chatted[1]["error"]


def test_the_python_api_takes_the_reasoning_options_in_llm_chat_and_generate(tmp_path, thinker):
    from batchjob import api

    (tmp_path / "t.jinja").write_text(QWEN3_THINKING)
    hello = [{"role": "user", "content": "hello"}]
    llm = api.LLM(str(thinker), dtype="float32", kv_cache_gb=0.05, reasoning_parser="qwen3",
                  chat_template=str(tmp_path / "t.jinja"), max_tokens=12, ignore_eos=True)
    [r] = llm.chat(hello, max_reasoning_tokens=4)  # LLM()'s parser and template, the call's budget
    assert r.reasoning_tokens == 4 and r.reasoning and r.text and r.completion_tokens == 12
    assert llm.generate([hello], max_reasoning_tokens=4) == [r]
    plain = api.LLM(str(thinker), dtype="float32", kv_cache_gb=0.05)
    [same] = plain.chat(hello, reasoning_parser="qwen3", chat_template=str(tmp_path / "t.jinja"), max_tokens=12,
                        ignore_eos=True, max_reasoning_tokens=4)  # the same, per call
    assert same == r
    [same] = api.chat(hello, model=str(thinker), dtype="float32", kv_cache_gb=0.05, reasoning_parser="qwen3",
                      chat_template=str(tmp_path / "t.jinja"), max_tokens=12, ignore_eos=True, max_reasoning_tokens=4)
    assert same == r
    with pytest.raises(ValueError, match=r"max_reasoning_tokens: needs reasoning_parser \(qwen3, deepseek_r1, gpt_oss "
                                         r"or auto\)"):
        plain.chat(hello, max_reasoning_tokens=4)


def test_the_reasoning_parser_help_names_every_parser():
    from batchjob.job.options.options import OPTIONS
    from batchjob.reasoning.parsers import PARSERS

    assert all(name in OPTIONS["reasoning_parser"].help for name in PARSERS)
