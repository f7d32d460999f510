"""Chat rows: the model's template or --chat-template FILE, --system-prompt, the generation prompt, and
template errors as per-row errors."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from click.testing import CliRunner

from batchjob.cli.main import main
from batchjob.job.options.config import JobConfig
from batchjob.io.parts import read_results
from batchjob.models.chat import render_chat
from batchjob.models.loader import load_model
from batchjob.job.rows.prompt_builder import PromptBuilder, RowError

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
)


def test_system_prompt_template_file_and_generation_prompt(tiny_model_dir):
    tok = load_model(str(tiny_model_dir("llama"))).tokenizer
    cfg = JobConfig(input="x", system_prompt="Be brief.")
    builder = PromptBuilder(cfg, tok, use_messages=True, chat_template=TEMPLATE)
    ids = builder.token_ids({"messages": [{"role": "user", "content": "Hi"}]})
    assert tok.decode(ids) == "[system] Be brief.\n[user] Hi\n[assistant] "
    own = builder.token_ids({"messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "Hi"}]})
    assert tok.decode(own) == "[system] Mine.\n[user] Hi\n[assistant] "  # a row's own system message wins
    model_template = PromptBuilder(JobConfig(input="x", chat=True), tok, use_messages=False)
    ids = model_template.token_ids({"prompt": "Hi"})  # --chat: a plain prompt as a user message, the model's ChatML
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    try:
        builder.token_ids({"messages": [{"role": "tool", "content": "42"}]})
    except RowError as e:
        assert "tool messages are not supported" in str(e)
    else:
        raise AssertionError("a template error must be a RowError")


def test_chat_rows_with_template_file_and_system_prompt_via_cli(tmp_path, tiny_model_dir):
    path = tiny_model_dir("llama", max_positions=1024)
    tok = load_model(str(path)).tokenizer
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    msgs = [[{"role": "user", "content": f"hello {i}"}] for i in range(3)]
    msgs.append([{"role": "tool", "content": "42"}])  # the template raises -> this row only fails
    pq.write_table(pa.table({"messages": msgs}), tmp_path / "chat.parquet")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["run", "--model", str(path), "--input", str(tmp_path / "chat.parquet"), "--output", str(out),
                                  "--max-tokens", "3", "--chat-template", str(tmp_path / "t.jinja"),
                                  "--system-prompt", "Be brief.", "--no-progress"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "4 rows (1 errors)" in r.output
    t = read_results(out)
    expected = render_chat(TEMPLATE, [{"role": "system", "content": "Be brief."}] + msgs[0], add_generation_prompt=True)
    assert t.column("prompt_tokens")[0].as_py() == len(tok.encode(expected, add_special_tokens=False))
    assert t.column("finish_reason")[3].as_py() == "error"
    assert "chat template failed: tool messages are not supported" in t.column("error")[3].as_py()
    assert all(t.column("error")[i].as_py() is None for i in range(3))


def test_a_batch_of_prompts_tokenizes_as_each_alone(tiny_model_dir):
    from batchjob.job.options.config import JobConfig
    from batchjob.models.loader import load_model
    from batchjob.job.rows.prompt_builder import PromptBuilder, RowError

    tok = load_model(str(tiny_model_dir("llama"))).tokenizer
    records = [{"prompt": "hello world"}, {"prompt": ""}, {"prompt": [5, 6, 7]}, {"prompt": "the quick brown fox " * 20},
               {"messages": [{"role": "user", "content": "hi"}]}, {"messages": "not json"}]
    builder = PromptBuilder(JobConfig(input="x"), tok, use_messages=True)
    batch = builder.token_ids_many(records)
    for record, got in zip(records, batch):
        try:
            want = builder.token_ids(record)
        except RowError as e:
            assert isinstance(got, RowError) and str(got) == str(e)
        else:
            assert got == want
    assert isinstance(batch[1], RowError) and batch[2] == [5, 6, 7]
