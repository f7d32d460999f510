"""What a job tells its operator: the start line, the summary and its final line, and the hint that an
instruct model probably wanted --chat."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchjob.io.sizes import format_bytes
from batchjob.job.process import threads as threads_module
from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import KvCacheDtype, Quantization, Scheduling, Task

if TYPE_CHECKING:  # the summary and its final line are also a rerun's verdict before torch is imported (preflight.py)
    from batchjob.engine.config import KvPool
    from batchjob.models.causal_lm import CausalLM
    from batchjob.models.loader import LoadedModel


@dataclass(slots=True)
class JobSummary:
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    output: str = ""
    stats: dict = field(default_factory=dict)
    stopped: str | None = None  # the signal that stopped the run before the end (exit 75: resumable)
    kernels: str = ""  # which kernel set ran (torch | native | triton)
    rows_before: int = 0  # committed by earlier runs
    errors_before: int = 0
    total_rows: int | None = None  # the job's rows, when known (after --limit)
    already_finished: bool = False  # every row was committed before this run: nothing ran
    empty_input: bool = False  # the input has no rows at all
    # tokens sampled in this run, rows finished or not (the rate shown while running); prefill-only jobs: computed
    generated_tokens_live: int = 0
    prefill_only: bool = False  # an embed or score job: its rate is prompt tokens/s (it generates none)
    # OpenAI Batch lines whose `model` names another model (name -> lines), answered by `model` all the same
    other_models: dict[str, int] = field(default_factory=dict)
    model: str = ""
    peak_rss_bytes: int | None = None  # the process's peak resident memory at the end of the run (stats.py)

    def line(self) -> str:
        """The final line: the whole job, then this run."""
        if self.already_finished:
            return f"batchjob: already finished: {self.rows_before:,} rows ({self.errors_before:,} errors) in {self.output}"
        if self.empty_input:
            return f"batchjob: the input was empty: 0 rows, nothing to do -> {self.output}"
        tps = (self.prompt_tokens if self.prefill_only else self.generated_tokens) / self.wall_s if self.wall_s else 0.0
        rate = "prompt tokens/s" if self.prefill_only else "tokens/s"
        rows, errors = self.rows_before + self.rows, self.errors_before + self.errors
        whole = (f"{rows:,} of {self.total_rows:,} rows" if self.total_rows is not None and rows != self.total_rows
                 else f"{rows:,} rows")
        state = "stopped" if self.stopped else "finished"
        this_run = (f"this run {self.rows} rows ({self.errors} errors), " if self.rows_before else
                    f"{self.rows} rows ({self.errors} errors), ")
        so = self.stats.get("structured")
        structured = (f"; structured outputs: {so['rows']:,} rows ({so['failed']} grammars refused), compiled in "
                      f"{so['compile_ms']} ms, masks {so['mask_ms_per_step']} ms a step" if so else "")
        others = ""
        if self.other_models:
            n = sum(self.other_models.values())
            names = ", ".join(f"{name!r}" for name in sorted(self.other_models, key=self.other_models.get, reverse=True)[:3])
            others = (f"; {n:,} request line{'s' if n != 1 else ''} named another model ({names}{', ...' if len(self.other_models) > 3 else ''}), "
                      f"answered by {self.model}")
        rss = f", peak RSS {format_bytes(self.peak_rss_bytes)}" if self.peak_rss_bytes else ""
        return (f"batchjob: {state}: {whole} ({errors:,} errors) in all; {this_run}{self.prompt_tokens} prompt tokens, "
                f"{self.generated_tokens} generated tokens in {self.wall_s:.1f}s ({tps:.1f} {rate}, {self.kernels} kernels{rss})"
                f"{structured}{others} -> {self.output}")


def start_line(cfg: JobConfig, loaded: LoadedModel, model: CausalLM, inputs: list[str], total: int | None,
               rows_before: int, output: str, kv_pool: KvPool | None = None) -> str:
    """The first line: the model and how it runs (its weight matmuls where quantized: `int8 matmuls`), the inputs
    and their rows, the output, the weights' size in memory by format, the KV pool's size and how it was chosen, and
    a resume's start."""
    rows = f"{total:,} rows" if total is not None else "rows: not known until read"
    if cfg.limit is not None:
        rows += f" (--limit {cfg.limit:,})"
    dtype = str(model.dtype).removeprefix('torch.')
    kv = dtype if model.kv_cache_dtype == KvCacheDtype.AUTO else model.kv_cache_dtype
    matmuls = "" if model.quantization == Quantization.NONE else f", {model.quantization} matmuls"
    import torch

    threads = torch.get_num_threads()
    waiting = f", {threads_module.chosen.words()}" if threads_module.chosen.words() and model.device.type == "cpu" else ""
    line = (f"batchjob: {loaded.name} ({dtype}{matmuls}, kv cache {kv}, {model.kernels.label} kernels, "
            f"{model.device.type}, {threads} thread{'' if threads == 1 else 's'}{waiting}) <- {', '.join(inputs)}, {rows} -> {output}")
    split = model.parallel  # each rank holds its slice: the sizes below are one rank's (every rank's alike)
    each = "" if split is None else " per rank"
    if split is not None:
        line += f"; tensor parallel over {split.world} ranks"
    line += f"; {weight_words(model.weight_memory())}{each}"
    if kv_pool is not None:
        line += f"; {kv_words(cfg, kv_pool)}{each}"
    if rows_before:
        line += f"; resuming: {rows_before:,}" + (f" of {total:,}" if total is not None else "") + " rows committed"
    return line


def weight_words(memory: dict[str, int]) -> str:
    """The weights' size in memory and its formats, largest first: "weights 668 MiB (Q4_K 468 MiB, Q6_K 197 MiB,
    bfloat16 2.1 MiB)" (a GGUF file computed as stored), "weights 2.00 GiB (bfloat16)"."""
    parts = sorted(memory.items(), key=lambda kv: -kv[1])
    if len(parts) == 1:
        return f"weights {format_bytes(parts[0][1])} ({parts[0][0]})"
    return f"weights {format_bytes(sum(memory.values()))} ({', '.join(f'{k} {format_bytes(v)}' for k, v in parts)})"


def kv_words(cfg: JobConfig, kv: KvPool) -> str:
    """The KV pool's size in memory and how it was chosen, with the option that changes it."""
    from batchjob.engine.config import KvSizing

    size, tokens = format_bytes(kv.nbytes), f"{kv.tokens:,} tokens"
    rows = f"{kv.rows:,} rows x {kv.row_tokens:,} tokens"
    rows_option = "--batch-size" if cfg.scheduling == Scheduling.STATIC else "--max-num-seqs"
    row_option = "--max-model-len" if cfg.max_model_len else "the model's context"
    each = f"{rows_option} x {row_option}"
    if kv.sizing == KvSizing.ROWS:
        return f"KV cache {size} ({rows}: {each}; --kv-cache-gb to set)"
    if kv.sizing == KvSizing.CEILING:
        return (f"KV cache {size}, {tokens} (the default's ceiling; {rows}, {each}, would take "
                f"{format_bytes(kv.rows_bytes)}; --kv-cache-gb or --max-model-len to change)")
    if kv.sizing == KvSizing.BYTES:
        return f"KV cache {size}, {tokens} (--kv-cache-gb)"
    if kv.sizing == KvSizing.GPU:
        return (f"KV cache {size}, {tokens} (what --gpu-memory-utilization {cfg.gpu_memory_utilization} leaves "
                "after the weights and the largest step)")
    return f"KV cache {size}, {tokens}"


class ChatHint:
    """Plain prompts into an instruct model often end at once (its end-of-turn token comes first): say once,
    as soon as the first rows show it, that --chat is probably wanted, so the operator can stop the job early."""
    EARLY_ROWS = 8  # rows finished before a running job says it
    FINAL_ROWS = 4  # enough at the end of a short job

    def __init__(self, cfg: JobConfig, loaded: LoadedModel, uses_messages: bool):
        self.wanted = cfg.task == Task.GENERATE and not (cfg.chat or uses_messages) and loaded.tokenizer.chat_template is not None
        self.model, self.column = loaded.name, cfg.messages_column

    def due(self, one_token_stops: tuple[int, int], final: bool = False) -> str | None:
        """The hint the first time most of the rows finished so far (at least EARLY_ROWS of them, FINAL_ROWS
        at the end) ended at their first token, else None. `one_token_stops`: (rows finished without error,
        of those: ended at their first token)."""
        ok, first = one_token_stops
        if not self.wanted or ok < (self.FINAL_ROWS if final else self.EARLY_ROWS) or first * 2 <= ok:
            return None
        self.wanted = False
        rows, then = (f"{first:,} of {ok:,} rows", "rerun") if final else \
            (f"{first:,} of the first {ok:,} rows", "stop the job (Ctrl-C) and rerun")
        return (f"batchjob: warning: {rows} ended at their first token; {self.model} has a chat template, so it "
                f"probably expects chat input: {then} with --chat --restart (each prompt becomes a user message; "
                f"--chat makes it another job) or give a `{self.column}` column")
