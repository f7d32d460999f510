"""The job's options, each declared once: its name, type, default, help, job-file table, whether it is part of
the job's identity (the fingerprint) and which keyword group of the Python API takes it. The command line's flags
(cli/run_options.py), the job file's tables and validation (job/options/config.py), the API's keywords (api.py), the
fingerprint (job/options/fingerprint.py) and docs/reference/run-options.md are all made from this table.

Adding an option: one `opt(...)` line below (and the code that reads it); a sampling parameter also needs its
field in SamplingParams (engine/params.py), which also says what the sampler does with it (a token it bans:
`SamplingParams.banned_next`), and, when the row's text or tokenizer shapes it, its part in the row planner
(job/rows/row_plan.py)."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from batchjob.errors import ConfigError
from batchjob.job.options.option_spec import Api, Bounds, Identity, Option, Table, opt  # noqa: F401 (the table's vocabulary)
from batchjob.job.options.modes import (Admission, AsyncScheduling, Device, Dtype, KernelChoice, KvCacheDtype, OutputFormat,
                                PartFormat, Pooling, Preemption, Quantization, Scheduling, SpeculativeMethod, Task)


SAMPLING, STRUCTURED, EMBED, ENGINE, OUTPUT = Table.SAMPLING, Table.STRUCTURED, Table.EMBED, Table.ENGINE, Table.OUTPUT
ALWAYS, WHEN_SET = Identity.ALWAYS, Identity.WHEN_SET


@dataclass(frozen=True, slots=True)
class JobConfig:
    """One job's options, validated once (job/options/config.py load_job) and never changed after: a value resolved later
    (an embed job's pooling from the model folder) makes a new JobConfig (`dataclasses.replace`)."""
    # the job: model, input, prompts, run control
    model: str = opt('smollm2',
        "'smollm2' (embedded SmolLM2-135M-Instruct GGUF, the default), a path to a HF folder or .gguf file, or "
        'an org/name[@revision] id found in the local Hugging Face cache (no network)')
    task: Task = opt(Task.GENERATE,
        "generate text (default); embed: one prefill per row, no text; the row's `embedding` (list<float32>) is"
        ' its final hidden states pooled (docs/guide/embeddings.md); score: one prefill per row, each prompt '
        "token's logprob, and a continuation's logprob and is_greedy (docs/guide/scoring.md)")
    continuation_column: str = opt('continuation',
        '--task score: the column with the text scored after the prompt (default: continuation; a row without '
        'one scores its whole prompt)')
    input: str = opt('',
        'input: .jsonl (also .jsonl.gz/.jsonl.zst), .csv/.tsv, .parquet, a folder of JSONL or Parquet files, a '
        'hive-partitioned Parquet folder, a `datasets` save_to_disk folder, or an OpenAI Batch file')
    input_format: str | None = opt(None,
        'input format: jsonl, jsonl.gz, jsonl.zst, csv, tsv, parquet, datasets or openai-batch (default: detected '
        'from the path; a JSONL file of OpenAI Batch requests is detected by its first 20 lines)')
    output: str = opt('', 'output folder of Arrow parts + manifest.json (default: out/<job file name>)')
    prompt_column: str = opt('prompt', 'column with the prompt text (default: prompt)', fingerprint=ALWAYS)
    messages_column: str = opt('messages',
        'column with chat messages [{role, content}] (default: messages; used when present)', fingerprint=ALWAYS)
    chat: bool = opt(False,
        'wrap a plain prompt as a user message and apply the chat template', api=Api.CHAT, fingerprint=ALWAYS)
    chat_template: str | None = opt(None,
        "Jinja chat template file overriding the model's own", api=Api.CHAT, fingerprint=ALWAYS)
    system_prompt: str | None = opt(None,
        'system message prepended to chat rows that have none', api=Api.CHAT, fingerprint=ALWAYS)
    chat_template_kwargs: str | dict | None = opt(None,
        "variables for the chat template, a JSON object (e.g. {\"enable_thinking\": false}); a row's own "
        "`chat_template_kwargs` column adds to them; any key is passed as vLLM passes it", api=Api.CHAT, fingerprint=WHEN_SET)
    reasoning_parser: str | None = opt(None,
        "split each answer's thinking into the `reasoning` column: qwen3, deepseek_r1, gpt_oss, or auto (from the "
        "chat template and vocabulary) (default: off)", api=Api.CHAT, fingerprint=WHEN_SET)
    adapters: str | dict | None = opt(None,
        "LoRA adapters by name: NAME=PATH,... (a PEFT folder, or an org/name in the local Hugging Face cache); "
        "the job file's [lora] adapters = {NAME = \"PATH\"}", table=Table.LORA, fingerprint=WHEN_SET, flag="--lora",
        api=Api.ENGINE)
    lora_column: str = opt("lora", "column naming each row's adapter (null or absent: the base model) (default: lora)",
        table=Table.LORA, fingerprint=WHEN_SET)
    max_loras: int = opt(8, "most distinct adapters in one step; rows of another wait a step (default: 8)",
        table=Table.LORA, bounds=Bounds(1), api=Api.ENGINE)
    max_lora_rank: int | None = opt(None, "largest adapter rank accepted (default: the largest given)",
        table=Table.LORA, fingerprint=WHEN_SET, bounds=Bounds(1), api=Api.ENGINE)
    tool_parser: str | None = opt(None,
        "parse the calls in answers to rows with `tools` into the `tool_calls` column: hermes, llama3_json, mistral, "
        "pythonic, or auto (from the chat template) (default: off)", api=Api.CHAT, fingerprint=WHEN_SET)
    limit_images_per_prompt: int | None = opt(None, "most images a chat row may carry (vLLM's limit_mm_per_prompt); "
        "a row with more fails alone (default: no limit)", api=Api.CHAT, fingerprint=WHEN_SET, bounds=Bounds(1))
    image_column: str | None = opt(None, "column of each row's images (bytes, a path or url, a datasets Image, a "
        'list): the row becomes a user message of its images, then its prompt', fingerprint=WHEN_SET)
    lanes: list[dict] = opt([],
        '[[lanes]] tables: name, priority, weight, input, max_tokens (docs/guide/scheduling.md)', fingerprint=ALWAYS,
        flag="")
    lane_column: str = opt('lane',
        "column naming each row's lane when [[lanes]] are declared without inputs (default: lane)", fingerprint=ALWAYS)
    progress: bool = opt(True, 'a progress bar on a terminal, else a line every --log-every seconds (default: on)')
    log_every: float = opt(30.0, 'seconds between progress lines when stderr is not a terminal (default: 30)')
    limit: int | None = opt(None, 'run only the first N input rows (a trial run); rerun without it to do the rest')
    drain_timeout: float = opt(60.0,
        'after SIGINT/SIGTERM/SIGUSR1: seconds the running rows get to finish before the job commits and exits '
        'with 75 (resumable) (default: 60)')
    max_errors: int | float | None = opt(None,
        'fail the job (exit 1, everything done so far committed) when more rows fail than this: a count (10) or'
        ' a fraction of the rows (0.1 or 10%) (default: no limit)')
    shard: str | None = opt(None,
        'K/N: run the K-th (0-based) of N contiguous slices of the input into OUTPUT/shard-K-of-N/ (default '
        "inside a Slurm array task: from SLURM_ARRAY_TASK_ID/COUNT; in a Kubernetes Indexed Job pod: from "
        "JOB_COMPLETION_INDEX/JOB_COMPLETIONS; 'none': no sharding)")
    data_parallel: str | None = opt(None,
        "N: run the job as N processes on this node, each on its own GPU or its own cores (inside one NUMA node "
        "where there are several), handing out shards of the input as they ask for work, into one output folder "
        "(sharded: OUTPUT/shard-K-of-M/); 'auto': one per GPU, or one per NUMA node on a CPU (default: one "
        'process; docs/guide/data-parallel.md)')

    # sampling
    max_tokens: int = opt(256,
        'maximum generated tokens per row (default: 256)', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    temperature: float = opt(0.0,
        'sampling temperature; 0 = greedy (default: 0)', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    top_p: float = opt(1.0,
        'nucleus sampling mass (default: 1.0 = off)', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    top_k: int = opt(0, 'top-k sampling (default: 0 = off)', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    seed: int = opt(0,
        "job seed; each row's random stream derives from (seed, row index) (default: 0)",
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    stop_token_ids: list[int] = opt([],
        'comma-separated token ids that end a row (besides EOS)', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    allowed_token_ids: list[int] = opt([],
        'comma-separated token ids: only these may be generated, as vLLM\'s allowed_token_ids (default: any)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=WHEN_SET)
    ignore_eos: bool = opt(False,
        'keep generating past EOS until max_tokens', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    min_tokens: int = opt(0,
        'EOS, stop tokens and stop strings are held back until this many tokens (default: 0)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    min_p: float = opt(0.0,
        'drop tokens less likely than min_p x the most likely one (default: 0 = off)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    repetition_penalty: float = opt(1.0,
        'vLLM/HF repetition penalty over prompt + output tokens (default: 1 = off)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    presence_penalty: float = opt(0.0,
        'OpenAI presence penalty over output tokens, in [-2, 2] (default: 0)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    frequency_penalty: float = opt(0.0,
        'OpenAI frequency penalty over output tokens, in [-2, 2] (default: 0)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    stop: list[str] = opt([],
        'a stop string, or a JSON list of them; matched on the text, cut from the output',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS, texts=True)
    bad_words: list[str] = opt([],
        "a word the output may not contain, or a JSON list of them, as vLLM's bad_words: the word's last token is "
        'never sampled after its others (the word tokenized alone and after a space)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=WHEN_SET, texts=True)
    include_stop_str_in_output: bool = opt(False,
        'keep the matched stop string at the end of the text', table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    logprobs: int | None = opt(None,
        'log-probabilities of each generated token and of the top N alternatives (0..20)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    prompt_logprobs: int | None = opt(None,
        'log-probabilities of each prompt token and of the top N alternatives (0..20); --task score: 0 unless '
        'set', table=SAMPLING, api={Api.SAMPLING, Api.SCORE}, fingerprint=WHEN_SET, bounds=Bounds(0, 20))
    n: int = opt(1,
        'completions per row, each with its own random stream (default: 1)',
        table=SAMPLING, api=Api.SAMPLING, fingerprint=ALWAYS)
    max_reasoning_tokens: int | None = opt(None,
        "thinking budget: once a row has thought this many tokens it is made to close its thinking and answer "
        "(needs reasoning_parser; default: none)", table=SAMPLING, api=Api.SAMPLING, fingerprint=WHEN_SET, bounds=Bounds(1))

    # structured_outputs
    json_schema: str | dict | None = opt(None,
        "structured outputs: every row's output is JSON matching this schema (a file, or the schema's JSON "
        "text); a row's own `structured_outputs` wins", table=STRUCTURED, api=Api.SAMPLING)
    json_object: bool = opt(False,
        "structured outputs: every row's output is a JSON object", table=STRUCTURED, api=Api.SAMPLING)
    regex: str | None = opt(None,
        "structured outputs: every row's output matches this regular expression", table=STRUCTURED, api=Api.SAMPLING)
    choice: list[str] = opt([],
        "structured outputs: every row's output is one of these strings (comma-separated, or a JSON list)",
        table=STRUCTURED, api=Api.SAMPLING)
    grammar: str | None = opt(None,
        "structured outputs: every row's output matches this Lark or GBNF grammar (a file, or its text)",
        table=STRUCTURED, api=Api.SAMPLING)

    # embed
    pooling: Pooling | None = opt(None,
        '--task embed: the last prompt position, the mean over the prompt, or the first position (default: the '
        "model folder's sentence-transformers 1_Pooling/config.json, else last)", table=EMBED, api=Api.EMBED)
    normalize: bool = opt(True, '--task embed: L2-normalise each embedding (default: on)', table=EMBED, api=Api.EMBED)
    dimensions: int | None = opt(None,
        '--task embed: keep the first N values (Matryoshka), then normalise (default: all)',
        table=EMBED, api=Api.EMBED, bounds=Bounds(1))
    embed_prefix: str = opt('',
        "--task embed: text prepended to each prompt, e.g. an instruction or 'query: ' (default: none)",
        table=EMBED, api=Api.EMBED)
    truncate: bool = opt(False,
        '--task embed: a prompt longer than the context keeps its first max_model_len tokens, as embedding '
        'servers do (default: off: the row fails, naming its length)', table=EMBED, api=Api.EMBED)

    # engine
    dtype: Dtype | None = opt(None,
        'compute dtype (default: bfloat16 on CUDA and on CPUs with bf16 matmul, else float32)',
        table=ENGINE, api=Api.ENGINE)
    device: Device | None = opt(None, 'device (default: cuda when available)', table=ENGINE, api=Api.ENGINE)
    kernels: KernelChoice = opt(KernelChoice.AUTO,
        'model kernels: torch references, native (C++ for this CPU, compiled at first use), triton (CUDA, or '
        'the CPU under TRITON_INTERPRET=1), or auto: native where it builds, else torch (default: auto)',
        table=ENGINE, api=Api.ENGINE)
    scheduling: Scheduling = opt(Scheduling.CONTINUOUS,
        'continuous batching (default) or classic static batching, for comparison', table=ENGINE, api=Api.ENGINE)
    batch_size: int = opt(16, "static batching's batch size (default: 16)", table=ENGINE, api=Api.ENGINE)
    max_num_seqs: int = opt(128, 'most rows in one step (default: 128)', table=ENGINE, api=Api.ENGINE)
    max_num_batched_tokens: int | None = opt(None,
        'token budget of one step (default: 512 on a CPU, as llama.cpp\'s micro-batch: on a 1B-class model as fast as '
        '2048 and 0.1-0.2 GiB less activation memory; 2048 on CUDA)', table=ENGINE, api=Api.ENGINE)
    prefill_chunk: int = opt(0,
        "cap on one row's prompt chunk per step (default: 0 = budget only)", table=ENGINE, api=Api.ENGINE)
    block_size: int = opt(16, 'KV cache block size in tokens (default: 16)', table=ENGINE, api=Api.ENGINE)
    max_model_len: int | None = opt(None,
        "cap on a row's prompt + generated tokens, below the model's context: a row reaching it ends with "
        "`length`, a longer prompt is a row error (default: the model's context, and what the KV cache holds)",
        table=ENGINE, api=Api.ENGINE, fingerprint=WHEN_SET)
    kv_cache_gb: float | None = opt(None,
        'KV cache memory in GiB (default: on the CPU what --max-num-seqs rows of --max-model-len tokens (else the '
        "model's context) fill, at most 1.0; on CUDA, what --gpu-memory-utilization leaves; the start line says "
        'which)',
        table=ENGINE, api=Api.ENGINE)
    gpu_memory_utilization: float = opt(0.9,
        "CUDA: share of the GPU's memory for weights, activations and the KV cache, sized after a profiling "
        'forward at the largest step (default: 0.9)',
        table=ENGINE, api=Api.ENGINE, bounds=Bounds(0, 1, low_open=True))
    speculative: SpeculativeMethod = opt(SpeculativeMethod.NONE,
        'speculative decoding: ngram = prompt lookup (a row proposes what followed the last match of its last '
        'tokens in its own prompt and output); the target verifies the proposals in the normal batch, so the '
        'text is the same as without it; draft = a smaller model proposes (--draft-model) (default: none)',
        table=ENGINE, api=Api.ENGINE)
    draft_model: str | None = opt(None,
        "--speculative draft: the draft model (a HF folder or .gguf file with the target's tokenizer, e.g. a "
        'smaller model of the same family)', table=ENGINE, api=Api.ENGINE)
    num_speculative_tokens: int = opt(4,
        'tokens proposed per row and step (default: 4)', table=ENGINE, api=Api.ENGINE, bounds=Bounds(1, 16))
    speculative_max_rows: int = opt(32,
        'no proposals in a step with more decoding rows than this: a full batch gains little from them '
        '(default: 32)', table=ENGINE, api=Api.ENGINE, bounds=Bounds(0))
    tensor_parallel: int = opt(1,
        'N: split the model over N processes on this node (torch.distributed: gloo on a CPU, NCCL on CUDA), each '
        "holding 1/N of the attention heads, KV cache, MLP and vocabulary, on its own cores or GPU; an HF folder's "
        'Llama, Mistral, Qwen2/3, Gemma 2/3 or Phi-3 (default: 1; docs/guide/data-parallel.md)',
        table=ENGINE, api=Api.ENGINE)
    kv_cache_dtype: KvCacheDtype = opt(KvCacheDtype.AUTO,
        'KV cache: auto = the compute dtype; int8 (absmax per token and KV head, ~1.9x the tokens of bf16) or '
        'int4 (groups of 16 along head_dim, ~3.2x); read by every backend: native (every CPU path), Triton and '
        'the torch references (default: auto)', table=ENGINE, api=Api.ENGINE, fingerprint=WHEN_SET)
    quantization: Quantization = opt(Quantization.AUTO,
        "weight matmuls: auto = the checkpoint's (a GGUF file's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K tensors "
        'computed as stored on a CPU, in their blocks: the file\'s size in memory; a compressed-tensors W8A8 int8 '
        'folder runs int8 and a W4A16 one int4, their codes as stored; a W8A8 fp8 one fp8 where fp8 runs, else '
        'dequantized at load; a float one: none); none = the compute dtype (a GGUF file dequantized at load); '
        'int8 = W8A8, any bf16/fp32 checkpoint quantized at load (weights per output channel, '
        'activations per token at run time; the LM head too; embeddings and norms stay in the compute dtype), '
        'CPU (our native int8 GEMM on every CPU: 1.5x W1 tokens/s over bf16 on AMD Zen 4 (AVX512-VNNI), 1.5x '
        "the fp32 default's job speed on Zen 3 (AVX2)) and CUDA (Triton); about +4% perplexity on SmolLM2-135M; "
        'int4 = weights in symmetric int4 groups of 32 quantized at load (a quarter of bf16\'s memory; the LM '
        'head int8), computed by the CPU kernels of GGUF blocks, on CUDA by a Triton W4A16 kernel '
        '(docs/guide/quantization.md); fp8 = W8A8 float8 e4m3 on a CUDA GPU with compute capability >= 8.9 '
        '(Triton; the LM head stays in the compute dtype; untested on a GPU so far, verified under the Triton '
        'interpreter only), refused elsewhere. An option that conflicts with a pre-quantized checkpoint is an '
        'error (default: auto)', table=ENGINE, api=Api.ENGINE)
    async_scheduling: AsyncScheduling = opt(AsyncScheduling.AUTO,
        'schedule and launch step N+1 while step N runs on the device, then collect N (default: auto = on CUDA;'
        ' the text is the same either way)', table=ENGINE, api=Api.ENGINE)
    cuda_graphs: bool = opt(True,
        'CUDA with the Triton kernels: decode steps replay CUDA graphs captured at padded batch sizes (default:'
        ' on)', table=ENGINE, api=Api.ENGINE)
    admission: Admission = opt(Admission.OPTIMISTIC,
        'admit a row when prompt + a watermark fits (optimistic, relies on preemption) or prompt + max_tokens '
        '(reserve, never preempts)', table=ENGINE, api=Api.ENGINE)
    preemption: Preemption = opt(Preemption.AUTO,
        'under memory pressure: recompute the row later, swap its KV to host memory, or choose by measured cost'
        ' (default: auto)', table=ENGINE, api=Api.ENGINE)
    swap_space_gb: float = opt(1.0,
        'host memory for swapped-out KV blocks in GiB (default: 1.0)', table=ENGINE, api=Api.ENGINE)
    max_wait: float = opt(300.0,
        'seconds after which a waiting row goes ahead of every lane (aging bound; default: 300)',
        table=ENGINE, api=Api.ENGINE)
    prefix_caching: bool = opt(True,
        'reuse KV blocks of identical prompt prefixes (default: on)', table=ENGINE, api=Api.ENGINE)
    encoder_cache_tokens: int = opt(16384,
        "image rows: keep image encoder outputs by the image's digest, up to this many placeholder tokens, so a "
        'picture several rows ask about is encoded once (vLLM\'s encoder cache); 0 = off (default: 16384)',
        table=ENGINE, api=Api.ENGINE, bounds=Bounds(low=0))
    max_num_encoder_tokens: int = opt(0,
        "image rows: image placeholder tokens a step may send to the image encoder; a row whose chunk would start "
        "one more image computes its text up to it and reads it the next step (vLLM's encoder budget); images in the "
        'encoder cache cost nothing; 0 = the step\'s token budget (default: 0)',
        table=ENGINE, api=Api.ENGINE, bounds=Bounds(low=0))
    read_ahead: int = opt(0,
        'rows queued in the engine per lane (bounded memory); 0 = 2 x max_num_seqs (default)',
        table=ENGINE, api=Api.ENGINE)
    threads: int = opt(0,
        'CPU threads (default: 0 = the CPUs this process may use: its affinity, as Slurm and taskset set it, '
        'capped by a cgroup CPU quota, as containers set it); on a machine shared with other work, fewer '
        '(docs/guide/models-and-kernels.md, Threads)', table=ENGINE, api=Api.ENGINE)

    # output
    keep_columns: list[str] = opt([],
        'comma-separated input columns copied into the output', table=OUTPUT, fingerprint=ALWAYS)
    id_column: str | None = opt(None,
        'the input column that identifies a row, copied into the output (default: id or custom_id when the '
        "input has one; 'none': no id column)", table=OUTPUT)
    part_rows: int = opt(1000, 'commit a part every N rows (default: 1000)', table=OUTPUT)
    part_seconds: float = opt(30.0, '... or every T seconds (default: 30)', table=OUTPUT)
    part_format: PartFormat = opt(PartFormat.ARROW,
        'part files as Arrow IPC (default) or Parquet (zstd; readable by DuckDB, Spark, BigQuery)', table=OUTPUT)
    output_format: OutputFormat = opt(OutputFormat.ARROW,
        'openai-batch: also write OUTPUT/results.jsonl (OpenAI Batch responses) and OUTPUT/errors.jsonl (failed'
        ' requests) at the end (default: arrow)', table=OUTPUT)

    # where the values came from (not an option): the job file, for messages
    job_file: str | None = None

    def sampling_defaults(self, max_tokens: int | None = None):
        """The job's SamplingParams (a lane may set its own max_tokens); rows may override each field."""
        from batchjob.engine.requests import SamplingParams

        values = {name: getattr(self, name) for name in SAMPLING_PARAMS}
        if max_tokens:
            values["max_tokens"] = max_tokens
        if self.task == Task.SCORE:  # a scoring row: max_tokens 0, prompt logprobs (0: no alternatives)
            values.update(max_tokens=0, prompt_logprobs=self.prompt_logprobs or 0)
        return SamplingParams.parse({**values, "structured_outputs": self.structured_outputs(),
                                     "pooling": self.pooling_params()})

    def pooling_params(self):
        """The embed task's PoolingParams (None for generate); an unset pooling is `last` until the job
        resolves it from the model folder (job/rows/embed_task.py)."""
        from batchjob.engine.requests import PoolingParams

        if self.task != Task.EMBED:
            return None
        return PoolingParams(self.pooling or Pooling.LAST, self.normalize, self.dimensions)

    def structured_outputs(self) -> dict | None:
        """The job-wide structured_outputs (vLLM's names) from json_schema / json_object / regex / choice / grammar."""
        given = {name: value for name, value in (("json_schema", self.json_schema), ("json_object", self.json_object or None),
                                                ("regex", self.regex), ("choice", self.choice or None),
                                                ("grammar", self.grammar)) if value is not None}
        if len(given) > 1:
            raise ConfigError(f"{', '.join(given)}: give at most one structured output for the job "
                              "(json_schema, json_object, regex, choice or grammar)")
        if not given:
            return None
        (name, value), = given.items()
        if name in ("json_schema", "grammar") and isinstance(value, str) and _is_file(value):
            value = Path(value).read_text()  # a file; else the text itself
        if name == "json_schema" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"json_schema: {value!r:.80} is neither a file nor JSON text ({e})") from None
        return {"json" if name == "json_schema" else name: value}

    @property
    def read_ahead_rows(self) -> int:
        """Rows queued in the engine (per lane) beyond the running ones: read_ahead, or 2 x max_num_seqs."""
        return self.read_ahead or 2 * self.max_num_seqs

    @property
    def per_lane_inputs(self) -> bool:
        return bool(self.lanes) and all(isinstance(lane, dict) and lane.get("input") for lane in self.lanes)


OPTIONS: dict[str, Option] = {f.name: f.metadata["option"] for f in dataclasses.fields(JobConfig) if f.metadata}
FIELDS = {f.name: f for f in dataclasses.fields(JobConfig) if f.name in OPTIONS}
# each option's default value (a list option's too: its field has a factory, not a default)
DEFAULTS: dict[str, Any] = {name: f.default_factory() if f.default is dataclasses.MISSING else f.default
                            for name, f in FIELDS.items()}
TYPES: dict[str, Any] = {name: t for name, t in typing.get_type_hints(JobConfig).items() if name in OPTIONS}
# the options that are SamplingParams fields of the same name (the job's `seed` is the job's, not a row's)
SAMPLING_PARAMS = tuple(name for name, o in OPTIONS.items() if o.table is Table.SAMPLING and name != "seed")
# the options whose values are free texts (`stop`): one text, or a JSON list of them
TEXT_LISTS = tuple(name for name, o in OPTIONS.items() if o.texts)


def api_keywords(*groups: Api) -> tuple[str, ...]:
    """The Python API's keywords in these groups, in the table's order."""
    return tuple(name for name, o in OPTIONS.items() if o.api & set(groups))


def names_in(table: Table) -> tuple[str, ...]:
    return tuple(name for name, o in OPTIONS.items() if o.table is table)


def scalar_types(name: str) -> tuple:
    """An option's type as the members of its union: (int, NoneType) for `int | None`, (list[str],) for a list."""
    typ = TYPES[name]
    return typing.get_args(typ) if isinstance(typ, types.UnionType) else (typ,)


def mode_of(name: str) -> type[Enum] | None:
    """The enum an option's values come from (Task for `task`), or None."""
    return next((t for t in scalar_types(name) if isinstance(t, type) and issubclass(t, Enum)), None)


def _is_file(value: str) -> bool:
    try:
        return "\n" not in value and Path(value).is_file()
    except OSError:  # text too long to be a path
        return False
