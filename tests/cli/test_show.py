"""`batchjob show OUT`: the same summary and rows as `python -m batchjob.cli.show OUT`, and its errors."""
from __future__ import annotations

import subprocess
import sys

from click.testing import CliRunner

from batchjob.cli import show
from batchjob.cli.main import main
from batchjob.io.sink import ArrowSink

FP = {"model": "tiny", "temperature": 0.0, "input": "data.jsonl"}


def result(i, **kept):
    return {"row_index": i, "generated_text": f"answer {i}", "finish_reason": "stop",
            "prompt_tokens": 3, "completion_tokens": i % 5, "error": None, **kept}


def finished(out):
    with ArrowSink(out, fingerprint=FP, keep_columns=["prompt"], total_rows=3) as sink:
        sink.write(result(1, prompt="Name a color."))
        sink.write(result(0, prompt="What is the capital of France?"))
    return out


def test_show_command_prints_what_the_module_prints(tmp_path, capsys):
    out = finished(tmp_path / "out")
    shown = CliRunner().invoke(main, ["show", str(out), "-n", "1", "--width", "20"], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert str(out.resolve()) in shown.output and "2 rows of 3" in shown.output
    assert "[0]\n  prompt: What is the capit...\n  -> answer 0" in shown.output and "[1]" not in shown.output
    assert show.main([str(out), "-n", "1", "--width", "20"]) == 0
    assert capsys.readouterr().out == shown.output


def test_show_command_on_a_folder_without_results_is_one_line_and_exit_1(tmp_path):
    (tmp_path / "empty").mkdir()
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "empty")])
    assert shown.exit_code == 1
    assert shown.output == f"batchjob: error: {tmp_path / 'empty'} has no manifest.json; run a job into it first\n"


def test_show_is_listed_and_the_module_form_still_runs(tmp_path):
    assert "show" in CliRunner().invoke(main, ["--help"]).output
    out = finished(tmp_path / "out")
    module = subprocess.run([sys.executable, "-m", "batchjob.cli.show", str(out), "-n", "2"],
                            capture_output=True, text=True, timeout=600)
    assert module.returncode == 0, module.stderr
    assert "first 2 rows (input order):\n[0]" in module.stdout


def test_show_prints_a_rows_reasoning_and_tool_calls(tmp_path):
    """A tool parser's row of calls alone is not shown empty; a reasoning parser's thinking is shown before the
    answer; a call that did not parse says why."""
    from batchjob.job.rows.results import OutputColumns

    columns = OutputColumns(keep=("prompt",), reasoning=True, tools=True)
    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    with ArrowSink(tmp_path / "out", fingerprint=FP, keep_columns=columns.names, total_rows=3,
                   column_types=columns.types) as sink:
        sink.write({**result(0, prompt="Weather in Paris?"), "generated_text": "", "finish_reason": "tool_calls",
                    "reasoning": "The user wants the weather.", "reasoning_tokens": 5, "tool_calls": [call],
                    "tool_call_error": None})
        sink.write({**result(1, prompt="Hi"), "generated_text": "Hello!", "reasoning": None, "reasoning_tokens": 0,
                    "tool_calls": None, "tool_call_error": None})
        sink.write({**result(2, prompt="Weather?"), "generated_text": "<tool_call>{bad", "reasoning": None,
                    "reasoning_tokens": 0, "tool_calls": None, "tool_call_error": "not JSON: {bad"})
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "out")], catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    rows = shown.output.split("first 3 rows (input order):\n")[1]
    assert rows.startswith("[0]\n  prompt: Weather in Paris?\n  reasoning: The user wants the weather.\n"
                           "  tool call: get_weather({\"city\": \"Paris\"})\n  (tool_calls, 3 prompt + 0 completion tokens)\n"
                           "[1]\n  prompt: Hi\n  -> Hello!\n"), rows
    assert "[2]\n  prompt: Weather?\n  -> <tool_call>{bad\n  tool call error: not JSON: {bad\n" in rows
