"""Runs a job: source rows -> prompt ids -> engine -> result rows -> Arrow sink. Streams with a bounded
read-ahead, so memory does not grow with the number of rows."""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import batchjob
from batchjob.config import JobConfig
from batchjob.device import choose_device, choose_dtype
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sampler import row_key
from batchjob.engine.scheduler import SchedulerConfig
from batchjob.engine.sequence import SamplingParams, Sequence
from batchjob.io.sink import ArrowSink
from batchjob.io.sources import open_source, validate_columns
from batchjob.models.llama import LlamaModel
from batchjob.models.loader import load_model
from batchjob.requests import PromptBuilder, RowError


@dataclass(slots=True)
class JobSummary:
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    output: str = ""

    def line(self) -> str:
        tps = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        return (f"batchjob: {self.rows} rows ({self.errors} errors), {self.prompt_tokens} prompt tokens, "
                f"{self.generated_tokens} generated tokens in {self.wall_s:.1f}s ({tps:.1f} tokens/s) -> {self.output}")


def sampling_params(cfg: JobConfig) -> SamplingParams:
    return SamplingParams(
        max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        stop_token_ids=tuple(cfg.stop_token_ids), ignore_eos=cfg.ignore_eos,
    )


def build_engine(cfg: JobConfig, loaded, device: str, dtype: torch.dtype) -> Engine:
    model = LlamaModel(loaded.config, loaded.weights, dtype, device)
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        prefill_chunk=cfg.prefill_chunk, static_batch=cfg.batch_size if cfg.scheduling == "static" else 0,
    )
    if cfg.scheduling == "static":
        # a static batch is prefilled whole, then decoded until its longest row ends
        sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, 1 << 20)
    ecfg = EngineConfig(block_size=cfg.block_size, kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)), scheduler=sched)
    return Engine(model, loaded.tokenizer.eos_token_ids, ecfg)


def fingerprint(cfg: JobConfig, source, loaded) -> dict:
    p = Path(cfg.input)
    files = sorted(p.rglob("*")) if p.is_dir() else [p]
    return {
        "batchjob": batchjob.__version__,
        "input": {
            "path": str(p.resolve()),
            "files": [[str(f.relative_to(p)) if p.is_dir() else f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files if f.is_file()],
            "columns": list(source.columns),
        },
        "model": loaded.identity,
        "params": {k: v for k, v in asdict(cfg).items() if k in (
            "prompt_column", "messages_column", "chat", "chat_template", "system_prompt", "keep_columns",
            "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "dtype")},
    }


def run_job(cfg: JobConfig) -> JobSummary:
    t0 = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = open_source(cfg.input, input_format=cfg.input_format)
    use_messages = cfg.messages_column in source.columns
    if not use_messages:
        validate_columns(source, [cfg.prompt_column])
    validate_columns(source, cfg.keep_columns)
    device = choose_device(cfg.device)
    dtype = choose_dtype(cfg.dtype, device)
    loaded = load_model(cfg.model, dtype=dtype)
    template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
    builder = PromptBuilder(cfg, loaded.tokenizer, use_messages, template)
    fp = fingerprint(cfg, source, loaded)
    fp["params"]["dtype"] = str(dtype).removeprefix("torch.")
    sink = ArrowSink(Path(cfg.output), fingerprint=fp, keep_columns=cfg.keep_columns,
                     part_rows=cfg.part_rows, part_seconds=cfg.part_seconds, total_rows=source.num_rows)
    engine = build_engine(cfg, loaded, device, dtype)
    params = sampling_params(cfg)
    summary = JobSummary(output=str(cfg.output))
    already = sink.done.count()
    total = (source.num_rows - already) if source.num_rows is not None else None

    progress = None
    if cfg.progress and sys.stderr.isatty():
        from tqdm import tqdm
        progress = tqdm(total=total, unit="row", desc="batchjob", dynamic_ncols=True)

    kept: dict[int, dict] = {}  # row_index -> kept input columns, while the row is in flight
    rows = source.rows(skip=sink.done)
    read_ahead = 2 * cfg.max_num_seqs
    exhausted = False
    tok = loaded.tokenizer

    def emit(row_index: int, text: str, reason: str, n_prompt: int, n_out: int, error: str | None) -> None:
        result = {"row_index": row_index, "generated_text": text, "finish_reason": reason,
                  "prompt_tokens": n_prompt, "completion_tokens": n_out, "error": error}
        result.update(kept.pop(row_index, {}))
        sink.write(result)
        summary.rows += 1
        summary.errors += reason == "error"
        summary.prompt_tokens += n_prompt
        summary.generated_tokens += n_out
        if progress is not None:
            progress.update(1)
            el = time.perf_counter() - t0
            progress.set_postfix_str(f"{summary.generated_tokens / el:.0f} tok/s", refresh=False)

    try:
        while True:
            while not exhausted and len(engine.scheduler.waiting) < read_ahead:
                item = next(rows, None)
                if item is None:
                    exhausted = True
                    break
                record = item.record or {}
                kept[item.row_index] = {c: record.get(c) for c in cfg.keep_columns}
                if item.error:
                    emit(item.row_index, "", "error", 0, 0, item.error)
                    continue
                try:
                    ids = builder.token_ids(record)
                except RowError as e:
                    emit(item.row_index, "", "error", 0, 0, str(e))
                    continue
                seq = Sequence(item.row_index, ids, params, rng_key=row_key(cfg.seed, item.row_index))
                err = engine.add(seq)
                if err:
                    emit(item.row_index, "", "error", len(ids), 0, err)
            if not engine.has_work:
                break
            for seq in engine.step():
                emit(seq.seq_id, tok.decode(seq.output_ids), seq.finish_reason, seq.num_prompt, seq.num_output, None)
        sink.close()
    finally:
        if progress is not None:
            progress.close()
    summary.wall_s = time.perf_counter() - t0
    return summary
