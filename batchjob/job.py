"""Runs a job: source rows -> prompt ids -> engine -> result rows -> Arrow sink.

A job has one stream (one input, one output folder) or, with per-lane inputs, one stream per lane
(OUTPUT/<lane>/). Each stream reads ahead a bounded number of rows, so memory does not grow with
the number of rows."""
from __future__ import annotations

import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import batchjob
from batchjob.config import JobConfig
from batchjob.device import choose_device, choose_dtype
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.sampler import row_key
from batchjob.engine.scheduler import Lane, SchedulerConfig
from batchjob.engine.sequence import SamplingParams, Sequence
from batchjob.io.sink import ArrowSink
from batchjob.io.sources import InputRow, Source, open_source, validate_columns
from batchjob.models.llama import LlamaModel
from batchjob.models.loader import load_model
from batchjob.requests import PromptBuilder, RowError
from batchjob.stats import StatsRecorder


@dataclass(slots=True)
class JobSummary:
    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    output: str = ""
    stats: dict = field(default_factory=dict)

    def line(self) -> str:
        tps = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        return (f"batchjob: {self.rows} rows ({self.errors} errors), {self.prompt_tokens} prompt tokens, "
                f"{self.generated_tokens} generated tokens in {self.wall_s:.1f}s ({tps:.1f} tokens/s) -> {self.output}")


@dataclass(slots=True, eq=False)
class Stream:
    """One input and its output folder. `lane` is fixed for per-lane inputs, else chosen per row."""
    source: Source
    sink: ArrowSink
    lane: str | None
    key_salt: int = 0
    rows: Iterator[InputRow] | None = None
    exhausted: bool = False


def sampling_params(cfg: JobConfig, max_tokens: int | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
        stop_token_ids=tuple(cfg.stop_token_ids), ignore_eos=cfg.ignore_eos,
    )


def lanes_of(cfg: JobConfig) -> list[Lane]:
    if not cfg.lanes:
        return [Lane()]
    return [Lane(lane["name"], lane.get("priority", 0), float(lane.get("weight", 1.0))) for lane in cfg.lanes]


def build_engine(cfg: JobConfig, loaded, device: str, dtype: torch.dtype) -> Engine:
    model = LlamaModel(loaded.config, loaded.weights, dtype, device)
    static = cfg.scheduling == "static"
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, prefill_chunk=cfg.prefill_chunk,
        # a static batch is prefilled whole, then decoded until its longest row ends
        max_num_batched_tokens=1 << 20 if static else cfg.max_num_batched_tokens,
        static_batch=cfg.batch_size if static else 0, admission=cfg.admission, preemption=cfg.preemption,
        max_wait=cfg.max_wait, lanes=lanes_of(cfg),
    )
    ecfg = EngineConfig(block_size=cfg.block_size, kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)),
                        swap_space_bytes=int(cfg.swap_space_gb * (1 << 30)) if cfg.preemption != "recompute" else 0,
                        enable_prefix_caching=cfg.prefix_caching, scheduler=sched)
    return Engine(model, loaded.tokenizer.eos_token_ids, ecfg)


def input_identity(path: Path, source: Source) -> dict:
    files = sorted(f for f in path.rglob("*") if f.is_file()) if path.is_dir() else [path]
    return {
        "path": str(path.resolve()),
        "files": [[str(f.relative_to(path)) if path.is_dir() else f.name, f.stat().st_size, int(f.stat().st_mtime)] for f in files],
        "columns": list(source.columns),
    }


PARAM_FIELDS = ("prompt_column", "messages_column", "chat", "chat_template", "system_prompt", "keep_columns",
                "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "lanes", "lane_column")


def fingerprint(cfg: JobConfig, source: Source, input_path: str, loaded, dtype: torch.dtype) -> dict:
    params = {k: v for k, v in asdict(cfg).items() if k in PARAM_FIELDS}
    params["dtype"] = str(dtype).removeprefix("torch.")
    return {"batchjob": batchjob.__version__, "input": input_identity(Path(input_path), source),
            "model": loaded.identity, "params": params}


class Job:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        out = Path(cfg.output)
        if cfg.per_lane_inputs:
            inputs = [(lane["input"], out / lane["name"], lane["name"]) for lane in cfg.lanes]
        else:
            inputs = [(cfg.input, out, None)]
        sources = [(open_source(path, input_format=cfg.input_format), path, folder, lane) for path, folder, lane in inputs]
        self.use_messages = {}
        for source, *_ in sources:
            uses = cfg.messages_column in source.columns
            if not uses:
                validate_columns(source, [cfg.prompt_column])
            validate_columns(source, cfg.keep_columns)
            self.use_messages[id(source)] = uses
        device = choose_device(cfg.device)
        dtype = choose_dtype(cfg.dtype, device)
        self.loaded = load_model(cfg.model, dtype=dtype)
        template = Path(cfg.chat_template).read_text() if cfg.chat_template else None
        self.builders = {key: PromptBuilder(cfg, self.loaded.tokenizer, uses, template) for key, uses in self.use_messages.items()}
        self.lane_column_out = bool(cfg.lanes) and not cfg.per_lane_inputs  # rows pick lanes: record it per row
        keep = list(cfg.keep_columns) + (["lane"] if self.lane_column_out else [])
        self.streams = [
            Stream(source, ArrowSink(folder, fingerprint=fingerprint(cfg, source, path, self.loaded, dtype), keep_columns=keep,
                                     part_rows=cfg.part_rows, part_seconds=cfg.part_seconds, total_rows=source.num_rows),
                   lane, key_salt=zlib.crc32(lane.encode()) if lane else 0)
            for source, path, folder, lane in sources
        ]
        self.engine = build_engine(cfg, self.loaded, device, dtype)
        self.lanes = {lane.name: lane for lane in lanes_of(cfg)}
        self.params = {lane["name"]: sampling_params(cfg, lane.get("max_tokens")) for lane in cfg.lanes}
        self.default_params = sampling_params(cfg)
        self.in_flight: dict[int, tuple[Stream, int, dict]] = {}  # seq_id -> (stream, row_index, kept columns)
        self._next_seq = 0
        self.stats = StatsRecorder(out / "stats.jsonl")
        self.summary = JobSummary(output=str(out))

    # rows in

    def _lane_for(self, stream: Stream, record: dict) -> str:
        if stream.lane is not None:
            return stream.lane
        if not self.cfg.lanes:
            return "default"
        name = record.get(self.cfg.lane_column)
        if name is not None:
            if name not in self.lanes:
                raise RowError(f"column {self.cfg.lane_column!r}: unknown lane {name!r}; lanes: {', '.join(self.lanes)}")
            return name
        prio = record.get("priority")
        if prio is None:
            return next(iter(self.lanes))  # rows that name no lane go to the first declared lane
        match = [lane.name for lane in self.lanes.values() if lane.priority == prio]
        if not match:
            raise RowError(f"column 'priority': no lane has priority {prio!r}; lanes: "
                           + ", ".join(f"{lane.name}={lane.priority}" for lane in self.lanes.values()))
        return match[0]

    def _feed(self, stream: Stream, budget: int) -> None:
        cfg = self.cfg
        waiting = self.engine.scheduler.waiting
        queue_len = (lambda: len(waiting[stream.lane])) if stream.lane else (lambda: self.engine.scheduler.num_waiting)
        builder = self.builders[id(stream.source)]
        while not stream.exhausted and queue_len() < budget:
            item = next(stream.rows, None)
            if item is None:
                stream.exhausted = True
                return
            record = item.record or {}
            kept = {c: record.get(c) for c in cfg.keep_columns}
            if item.error:
                self._emit(stream, item.row_index, kept, error=item.error)
                continue
            try:
                lane = self._lane_for(stream, record)
                if self.lane_column_out:
                    kept["lane"] = lane
                ids = builder.token_ids(record)
            except RowError as e:
                self._emit(stream, item.row_index, kept, error=str(e))
                continue
            seq_id = self._next_seq
            self._next_seq += 1
            params = self.params.get(lane, self.default_params)
            seq = Sequence(seq_id, ids, params, rng_key=row_key(cfg.seed ^ stream.key_salt, item.row_index), lane=lane)
            err = self.engine.add(seq)
            if err:
                self._emit(stream, item.row_index, kept, error=err, prompt_tokens=len(ids))
                continue
            self.in_flight[seq_id] = (stream, item.row_index, kept)

    # rows out

    def _emit(self, stream: Stream, row_index: int, kept: dict, *, text: str = "", reason: str = "error",
              prompt_tokens: int = 0, completion_tokens: int = 0, error: str | None = None) -> None:
        row = {"row_index": row_index, "generated_text": text, "finish_reason": reason,
               "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "error": error}
        row.update(kept)
        stream.sink.write(row)
        s = self.summary
        s.rows += 1
        s.errors += reason == "error"
        s.prompt_tokens += prompt_tokens
        s.generated_tokens += completion_tokens
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix_str(f"{s.generated_tokens / (time.perf_counter() - self.t0):.0f} tok/s", refresh=False)

    def _finished(self, seq: Sequence) -> None:
        stream, row_index, kept = self.in_flight.pop(seq.seq_id)
        text = self.loaded.tokenizer.decode(seq.output_ids)
        self._emit(stream, row_index, kept, text=text, reason=seq.finish_reason,
                   prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output)

    # the loop

    def run(self) -> JobSummary:
        cfg = self.cfg
        self.t0 = time.perf_counter()
        self.progress = None
        total = None
        if all(s.source.num_rows is not None for s in self.streams):
            total = sum(s.source.num_rows - s.sink.done.count() for s in self.streams)
        if cfg.progress and sys.stderr.isatty():
            from tqdm import tqdm
            self.progress = tqdm(total=total, unit="row", desc="batchjob", dynamic_ncols=True)
        for stream in self.streams:
            stream.rows = stream.source.rows(skip=stream.sink.done)
        read_ahead = 2 * cfg.max_num_seqs
        engine = self.engine
        try:
            while True:
                for stream in self.streams:
                    self._feed(stream, read_ahead)
                if not engine.has_work:
                    break
                finished = engine.step()
                for seq in finished:
                    self._finished(seq)
                self.stats.step(engine.last_stats, finished)
            for stream in self.streams:
                stream.sink.close()
        finally:
            if self.progress is not None:
                self.progress.close()
        self.summary.wall_s = time.perf_counter() - self.t0
        self.summary.stats = self.stats.summary()
        self.stats.write(self.summary.stats)
        return self.summary


def run_job(cfg: JobConfig) -> JobSummary:
    return Job(cfg).run()
