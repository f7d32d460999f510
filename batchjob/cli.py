"""The `batchjob` command line."""
from __future__ import annotations

import sys

import click

from batchjob.config import ConfigError, load_job

# (flag, field, type, help). Every job-file field has a flag; a flag overrides the job file.
RUN_OPTIONS = [
    ("--model", "model", str, "'smollm2' (embedded SmolLM2-135M-Instruct GGUF, the default) or a path to a HF folder or .gguf file"),
    ("--input", "input", str, "input: .jsonl, .parquet, a folder of Parquet files, or a `datasets` save_to_disk folder"),
    ("--input-format", "input_format", click.Choice(["jsonl", "parquet", "datasets"]), "input format (default: detected from the path)"),
    ("--output", "output", str, "output folder of Arrow parts + manifest.json (default: out/<job file name>)"),
    ("--prompt-column", "prompt_column", str, "column with the prompt text (default: prompt)"),
    ("--messages-column", "messages_column", str, "column with chat messages [{role, content}] (default: messages; used when present)"),
    ("--chat/--no-chat", "chat", None, "wrap a plain prompt as a user message and apply the chat template"),
    ("--chat-template", "chat_template", str, "Jinja chat template file overriding the model's own"),
    ("--system-prompt", "system_prompt", str, "system message prepended to chat rows that have none"),
    ("--keep-columns", "keep_columns", str, "comma-separated input columns copied into the output"),
    ("--max-tokens", "max_tokens", int, "maximum generated tokens per row (default: 256)"),
    ("--temperature", "temperature", float, "sampling temperature; 0 = greedy (default: 0)"),
    ("--top-p", "top_p", float, "nucleus sampling mass (default: 1.0 = off)"),
    ("--top-k", "top_k", int, "top-k sampling (default: 0 = off)"),
    ("--seed", "seed", int, "job seed; each row's random stream derives from (seed, row index) (default: 0)"),
    ("--stop-token-ids", "stop_token_ids", str, "comma-separated token ids that end a row (besides EOS)"),
    ("--ignore-eos/--no-ignore-eos", "ignore_eos", None, "keep generating past EOS until max_tokens"),
    ("--dtype", "dtype", click.Choice(["float32", "bfloat16", "float16"]), "compute dtype (default: bfloat16 on CUDA and on CPUs with bf16 matmul, else float32)"),
    ("--device", "device", click.Choice(["cpu", "cuda"]), "device (default: cuda when available)"),
    ("--scheduling", "scheduling", click.Choice(["continuous", "static"]), "continuous batching (default) or classic static batching, for comparison"),
    ("--batch-size", "batch_size", int, "static batching's batch size (default: 16)"),
    ("--max-num-seqs", "max_num_seqs", int, "most rows in one step (default: 128)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step (default: 2048)"),
    ("--prefill-chunk", "prefill_chunk", int, "cap on one row's prompt chunk per step (default: 0 = budget only)"),
    ("--block-size", "block_size", int, "KV cache block size in tokens (default: 16)"),
    ("--kv-cache-gb", "kv_cache_gb", float, "KV cache memory in GiB (default: 1.0)"),
    ("--admission", "admission", click.Choice(["optimistic", "reserve"]), "admit a row when prompt + a watermark fits (optimistic, relies on preemption) or prompt + max_tokens (reserve, never preempts)"),
    ("--preemption", "preemption", click.Choice(["auto", "recompute", "swap"]), "under memory pressure: recompute the row later, swap its KV to host memory, or choose by measured cost (default: auto)"),
    ("--swap-space-gb", "swap_space_gb", float, "host memory for swapped-out KV blocks in GiB (default: 1.0)"),
    ("--max-wait", "max_wait", float, "seconds after which a waiting row goes ahead of every lane (aging bound; default: 300)"),
    ("--prefix-caching/--no-prefix-caching", "prefix_caching", None, "reuse KV blocks of identical prompt prefixes (default: on)"),
    ("--lane-column", "lane_column", str, "column naming each row's lane when [[lanes]] are declared without inputs (default: lane)"),
    ("--threads", "threads", int, "torch CPU threads (default: 0 = all cores)"),
    ("--part-rows", "part_rows", int, "commit a part every N rows (default: 1000)"),
    ("--part-seconds", "part_seconds", float, "... or every T seconds (default: 30)"),
    ("--progress/--no-progress", "progress", None, "progress bar on a terminal (default: on)"),
]


@click.group()
@click.version_option(package_name="batchjob")
def main() -> None:
    """batchjob: offline batch LLM inference with checkpoint-resume."""


def _run_command(fn):
    for flag, name, typ, help_ in reversed(RUN_OPTIONS):
        if typ is None:
            fn = click.option(flag, name, default=None, help=help_)(fn)
        else:
            fn = click.option(flag, name, type=typ, default=None, help=help_)(fn)
    return click.argument("job", required=False, type=click.Path(dir_okay=False))(fn)


@main.command("run")
@_run_command
def run_cmd(job: str | None, **overrides) -> None:
    """Run JOB (a TOML file whose keys are the option names below, with underscores; optional
    [sampling], [engine] and [output] tables). Flags override the file. Re-running the same command
    on an output folder with committed parts continues where it stopped."""
    from batchjob.io.sink import SinkError
    from batchjob.io.sources import SourceError
    from batchjob.models.config import UnsupportedModelError
    from batchjob.models.loader import ModelLoadError

    try:
        cfg = load_job(job, overrides)
        from batchjob.job import run_job

        summary = run_job(cfg)
    except (ConfigError, SourceError, ModelLoadError, UnsupportedModelError, SinkError) as e:
        click.echo(f"batchjob: error: {e}", err=True)
        sys.exit(1)
    click.echo(summary.line())


if __name__ == "__main__":
    main()
