"""`batchjob run`'s flags: one per job-file field, each overriding the job file's value."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click


@dataclass(slots=True, frozen=True)
class RunOption:
    flag: str  # "--max-tokens", or "--chat/--no-chat" for a boolean
    field: str  # the JobConfig field (and job-file key) it sets
    type: Any  # a click type, or None for a boolean flag pair
    help: str


# Every job-file field has a flag; a flag overrides the job file. docs/reference/run-options.md is made from
# this table (cli/reference.py).
RUN_OPTIONS = [RunOption(*entry) for entry in [
    ("--model", "model", str, "'smollm2' (embedded SmolLM2-135M-Instruct GGUF, the default), a path to a HF folder or .gguf file, or an "
     "org/name[@revision] id found in the local Hugging Face cache (no network)"),
    ("--task", "task", click.Choice(["generate", "embed", "score"]), "generate text (default); embed: one prefill per "
     "row, no text; the row's `embedding` (list<float32>) is its final hidden states pooled (docs/guide/embeddings.md); "
     "score: one prefill per row, each prompt token's logprob, and a continuation's logprob and is_greedy "
     "(docs/guide/scoring.md)"),
    ("--continuation-column", "continuation_column", str, "--task score: the column with the text scored after the "
     "prompt (default: continuation; a row without one scores its whole prompt)"),
    ("--pooling", "pooling", click.Choice(["last", "mean", "cls"]), "--task embed: the last prompt position, the mean "
     "over the prompt, or the first position (default: the model folder's sentence-transformers "
     "1_Pooling/config.json, else last)"),
    ("--normalize/--no-normalize", "normalize", None, "--task embed: L2-normalise each embedding (default: on)"),
    ("--dimensions", "dimensions", click.IntRange(1), "--task embed: keep the first N values (Matryoshka), then "
     "normalise (default: all)"),
    ("--embed-prefix", "embed_prefix", str, "--task embed: text prepended to each prompt, e.g. an instruction or "
     "'query: ' (default: none)"),
    ("--truncate/--no-truncate", "truncate", None, "--task embed: a prompt longer than the context keeps its first "
     "max_model_len tokens, as embedding servers do (default: off: the row fails, naming its length)"),
    ("--input", "input", str, "input: .jsonl (also .jsonl.gz/.jsonl.zst), .csv/.tsv, .parquet, a folder of JSONL or Parquet "
     "files, a hive-partitioned Parquet folder, a `datasets` save_to_disk folder, or an OpenAI Batch file"),
    ("--input-format", "input_format", click.Choice(["jsonl", "jsonl.gz", "jsonl.zst", "csv", "tsv", "parquet", "datasets", "openai-batch"]),
     "input format (default: detected from the path; a JSONL file of OpenAI Batch requests is detected by its first 20 lines)"),
    ("--output", "output", str, "output folder of Arrow parts + manifest.json (default: out/<job file name>)"),
    ("--prompt-column", "prompt_column", str, "column with the prompt text (default: prompt)"),
    ("--messages-column", "messages_column", str, "column with chat messages [{role, content}] (default: messages; used when present)"),
    ("--chat/--no-chat", "chat", None, "wrap a plain prompt as a user message and apply the chat template"),
    ("--chat-template", "chat_template", str, "Jinja chat template file overriding the model's own"),
    ("--system-prompt", "system_prompt", str, "system message prepended to chat rows that have none"),
    ("--keep-columns", "keep_columns", str, "comma-separated input columns copied into the output"),
    ("--id-column", "id_column", str, "the input column that identifies a row, copied into the output (default: id "
     "or custom_id when the input has one; 'none': no id column)"),
    ("--max-tokens", "max_tokens", int, "maximum generated tokens per row (default: 256)"),
    ("--temperature", "temperature", float, "sampling temperature; 0 = greedy (default: 0)"),
    ("--top-p", "top_p", float, "nucleus sampling mass (default: 1.0 = off)"),
    ("--top-k", "top_k", int, "top-k sampling (default: 0 = off)"),
    ("--seed", "seed", int, "job seed; each row's random stream derives from (seed, row index) (default: 0)"),
    ("--stop-token-ids", "stop_token_ids", str, "comma-separated token ids that end a row (besides EOS)"),
    ("--ignore-eos/--no-ignore-eos", "ignore_eos", None, "keep generating past EOS until max_tokens"),
    ("--min-tokens", "min_tokens", int, "EOS, stop tokens and stop strings are held back until this many tokens (default: 0)"),
    ("--min-p", "min_p", float, "drop tokens less likely than min_p x the most likely one (default: 0 = off)"),
    ("--repetition-penalty", "repetition_penalty", float, "vLLM/HF repetition penalty over prompt + output tokens (default: 1 = off)"),
    ("--presence-penalty", "presence_penalty", float, "OpenAI presence penalty over output tokens, in [-2, 2] (default: 0)"),
    ("--frequency-penalty", "frequency_penalty", float, "OpenAI frequency penalty over output tokens, in [-2, 2] (default: 0)"),
    ("--stop", "stop", str, "a stop string, or a JSON list of them; matched on the text, cut from the output"),
    ("--include-stop-str-in-output/--no-include-stop-str-in-output", "include_stop_str_in_output", None,
     "keep the matched stop string at the end of the text"),
    ("--logprobs", "logprobs", int, "log-probabilities of each generated token and of the top N alternatives (0..20)"),
    ("--prompt-logprobs", "prompt_logprobs", click.IntRange(0, 20), "log-probabilities of each prompt token and of the "
     "top N alternatives (0..20); --task score: 0 unless set"),
    ("--n", "n", int, "completions per row, each with its own random stream (default: 1)"),
    ("--json-schema", "json_schema", str, "structured outputs: every row's output is JSON matching this schema (a "
     "file, or the schema's JSON text); a row's own `structured_outputs` wins"),
    ("--json-object/--no-json-object", "json_object", None, "structured outputs: every row's output is a JSON object"),
    ("--regex", "regex", str, "structured outputs: every row's output matches this regular expression"),
    ("--choice", "choice", str, "structured outputs: every row's output is one of these strings (comma-separated, or "
     "a JSON list)"),
    ("--grammar", "grammar", str, "structured outputs: every row's output matches this Lark or GBNF grammar (a file, "
     "or its text)"),
    ("--dtype", "dtype", click.Choice(["float32", "bfloat16", "float16"]), "compute dtype (default: bfloat16 on CUDA and on CPUs with bf16 matmul, else float32)"),
    ("--device", "device", click.Choice(["cpu", "cuda"]), "device (default: cuda when available)"),
    ("--kernels", "kernels", click.Choice(["auto", "torch", "native", "triton"]),
     "model kernels: torch references, native (C++ for this CPU, compiled at first use), triton (CUDA, or the CPU "
     "under TRITON_INTERPRET=1), or auto: native where it builds, else torch (default: auto)"),
    ("--scheduling", "scheduling", click.Choice(["continuous", "static"]), "continuous batching (default) or classic static batching, for comparison"),
    ("--batch-size", "batch_size", int, "static batching's batch size (default: 16)"),
    ("--max-num-seqs", "max_num_seqs", int, "most rows in one step (default: 128)"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step (default: 2048)"),
    ("--prefill-chunk", "prefill_chunk", int, "cap on one row's prompt chunk per step (default: 0 = budget only)"),
    ("--block-size", "block_size", int, "KV cache block size in tokens (default: 16)"),
    ("--max-model-len", "max_model_len", int, "cap on a row's prompt + generated tokens, below the model's context: "
     "a row reaching it ends with `length`, a longer prompt is a row error (default: the model's context, and what "
     "the KV cache holds)"),
    ("--kv-cache-gb", "kv_cache_gb", float, "KV cache memory in GiB (default: 1.0 on the CPU; on CUDA, what --gpu-memory-utilization leaves)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", click.FloatRange(0, 1, min_open=True),
     "CUDA: share of the GPU's memory for weights, activations and the KV cache, sized after a profiling forward at the largest step (default: 0.9)"),
    ("--speculative", "speculative", click.Choice(["none", "ngram", "draft"]), "speculative decoding: ngram = prompt "
     "lookup (a row proposes what followed the last match of its last tokens in its own prompt and output); the "
     "target verifies the proposals in the normal batch, so the text is the same as without it; draft = a smaller "
     "model proposes (--draft-model) (default: none)"),
    ("--draft-model", "draft_model", str, "--speculative draft: the draft model (a HF folder or .gguf file with the "
     "target's tokenizer, e.g. a smaller model of the same family)"),
    ("--num-speculative-tokens", "num_speculative_tokens", click.IntRange(1, 16), "tokens proposed per row and step (default: 4)"),
    ("--speculative-max-rows", "speculative_max_rows", click.IntRange(0), "no proposals in a step with more decoding rows "
     "than this: a full batch gains little from them (default: 32)"),
    ("--kv-cache-dtype", "kv_cache_dtype", click.Choice(["auto", "int8", "int4"]), "KV cache: auto = the compute dtype; "
     "int8 (absmax per token and KV head, ~1.9x the tokens of bf16) or int4 (groups of 16 along head_dim, ~3.2x); "
     "read by every backend: native (every CPU path), Triton and the torch references (default: auto)"),
    ("--quantization", "quantization", click.Choice(["auto", "none", "int8", "fp8"]), "weight matmuls: auto = the "
     "checkpoint's (a compressed-tensors W8A8 int8 folder runs int8, its codes as stored; a W8A8 fp8 one fp8 where fp8 "
     "runs, else dequantized at load; a float one: none); none = the compute dtype; int8 = W8A8, any bf16/fp32 checkpoint quantized at load (weights per output channel, activations "
     "per token at run time; the LM head too; embeddings and norms stay in the compute dtype), CPU (our native int8 "
     "GEMM on every CPU: 1.5x W1 tokens/s over bf16 on AMD Zen 4 (AVX512-VNNI), 1.5x the fp32 default's job speed on Zen 3 (AVX2)) and CUDA (Triton); about +4% perplexity on SmolLM2-135M (docs/guide/quantization.md); "
     "fp8 = W8A8 float8 e4m3 on a CUDA GPU with compute capability >= 8.9 (Triton; the LM head stays in the compute "
     "dtype; untested on a GPU so far, verified under the Triton interpreter only), refused elsewhere. An option that conflicts with a pre-quantized "
     "checkpoint is an error (default: auto)"),
    ("--async-scheduling", "async_scheduling", click.Choice(["auto", "on", "off"]), "schedule and launch step N+1 "
     "while step N runs on the device, then collect N (default: auto = on CUDA; the text is the same either way)"),
    ("--cuda-graphs/--no-cuda-graphs", "cuda_graphs", None, "CUDA with the Triton kernels: decode steps replay CUDA "
     "graphs captured at padded batch sizes (default: on)"),
    ("--admission", "admission", click.Choice(["optimistic", "reserve"]), "admit a row when prompt + a watermark fits (optimistic, relies on preemption) or prompt + max_tokens (reserve, never preempts)"),
    ("--preemption", "preemption", click.Choice(["auto", "recompute", "swap"]), "under memory pressure: recompute the row later, swap its KV to host memory, or choose by measured cost (default: auto)"),
    ("--swap-space-gb", "swap_space_gb", float, "host memory for swapped-out KV blocks in GiB (default: 1.0)"),
    ("--max-wait", "max_wait", float, "seconds after which a waiting row goes ahead of every lane (aging bound; default: 300)"),
    ("--prefix-caching/--no-prefix-caching", "prefix_caching", None, "reuse KV blocks of identical prompt prefixes (default: on)"),
    ("--lane-column", "lane_column", str, "column naming each row's lane when [[lanes]] are declared without inputs (default: lane)"),
    ("--read-ahead", "read_ahead", int, "rows queued in the engine per lane (bounded memory); 0 = 2 x max_num_seqs (default)"),
    ("--threads", "threads", int, "CPU threads (default: 0 = the CPUs this process may use: its affinity, as Slurm "
     "and taskset set it, capped by a cgroup CPU quota, as containers set it); on a machine shared with other work, "
     "fewer (docs/guide/models-and-kernels.md, Threads)"),
    ("--part-rows", "part_rows", int, "commit a part every N rows (default: 1000)"),
    ("--part-seconds", "part_seconds", float, "... or every T seconds (default: 30)"),
    ("--part-format", "part_format", click.Choice(["arrow", "parquet"]), "part files as Arrow IPC (default) or Parquet "
     "(zstd; readable by DuckDB, Spark, BigQuery)"),
    ("--progress/--no-progress", "progress", None, "progress: a bar on a terminal, else a plain line every --log-every "
     "seconds (default: on)"),
    ("--log-every", "log_every", float, "seconds between progress lines when stderr is not a terminal (default: 30)"),
    ("--limit", "limit", int, "run only the first N input rows (a trial run); rerun without it to do the rest"),
    ("--drain-timeout", "drain_timeout", float, "after SIGINT/SIGTERM/SIGUSR1: seconds the running rows get to finish "
     "before the job commits and exits with 75 (resumable) (default: 60)"),
    ("--max-errors", "max_errors", str, "fail the job (exit 1, everything done so far committed) when more rows fail "
     "than this: a count (10) or a fraction of the rows (0.1 or 10%) (default: no limit)"),
    ("--output-format", "output_format", click.Choice(["arrow", "openai-batch"]),
     "openai-batch: also write OUTPUT/results.jsonl (OpenAI Batch responses) and OUTPUT/errors.jsonl (failed requests) at the end (default: arrow)"),
    ("--shard", "shard", str, "K/N: run the K-th (0-based) of N contiguous slices of the input into OUTPUT/shard-K-of-N/ "
     "(default inside a Slurm array task: from SLURM_ARRAY_TASK_ID/COUNT; 'none': no sharding)"),
]]


def run_options(fn):
    """The JOB argument and a click option per RUN_OPTIONS entry; an option not given is None, so the job
    file's value stands."""
    for o in reversed(RUN_OPTIONS):
        if o.type is None:
            fn = click.option(o.flag, o.field, default=None, help=o.help)(fn)
        else:
            fn = click.option(o.flag, o.field, type=o.type, default=None, help=o.help)(fn)
    return click.argument("job", required=False, type=click.Path(dir_okay=False))(fn)
