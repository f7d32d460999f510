"""Runs a job: source rows -> prompt ids -> engine -> result rows -> Arrow sink.

A job has one stream (one input, one output folder) or, with per-lane inputs, one stream per lane
(OUTPUT/<lane>/). Each stream reads ahead a bounded number of rows, so memory does not grow with
the number of rows."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

import batchjob
from batchjob.config import ConfigError, JobConfig
from batchjob.device import choose_device, choose_dtype
from batchjob.engine.engine import Engine, EngineConfig
from batchjob.engine.detokenizer import IncrementalDetokenizer
from batchjob.engine.sampler import sequence_key
from batchjob.engine.scheduler import Lane, SchedulerConfig
from batchjob.engine.sequence import SamplingParams, Sequence
from batchjob.io.lock import OutputLock
from batchjob.io.recovery import clear_results
from batchjob.io.sink import RESUME_POSITION, ArrowSink
from batchjob.io.openai_batch import RESULTS_FILE, OpenAIBatchSource, write_openai_batch
from batchjob.io.sources import InputRow, JsonlSource, Source, SourceError, open_source, validate_columns
from batchjob.models.llama import LlamaModel
from batchjob.models.loader import load_model, resolve_model_path
from batchjob.requests import PromptBuilder, RowError, row_sampling
from batchjob.results import OutputColumns, PendingRow, TokenText, output_columns
from batchjob.shard import ShardSource, ShardSpec, check_unsharded, claim_shard
from batchjob.stats import StatsRecorder
from batchjob.progress import Progress, Snapshot
from batchjob.stop import AllRowsFailed, ErrorBudget, StopSignals

log = logging.getLogger(__name__)
FEED_BATCH = 256  # rows read and tokenized together


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
    generated_tokens_live: int = 0  # tokens sampled in this run, rows finished or not (the rate shown while running)

    def line(self) -> str:
        """The final line: the whole job, then this run."""
        if self.already_finished:
            return f"batchjob: already finished: {self.rows_before:,} rows ({self.errors_before:,} errors) in {self.output}"
        if self.empty_input:
            return f"batchjob: the input was empty: 0 rows, nothing to do -> {self.output}"
        tps = self.generated_tokens / self.wall_s if self.wall_s else 0.0
        rows, errors = self.rows_before + self.rows, self.errors_before + self.errors
        whole = (f"{rows:,} of {self.total_rows:,} rows" if self.total_rows is not None and rows != self.total_rows
                 else f"{rows:,} rows")
        state = "stopped" if self.stopped else "finished"
        this_run = (f"this run {self.rows} rows ({self.errors} errors), " if self.rows_before else
                    f"{self.rows} rows ({self.errors} errors), ")
        return (f"batchjob: {state}: {whole} ({errors:,} errors) in all; {this_run}{self.prompt_tokens} prompt tokens, "
                f"{self.generated_tokens} generated tokens in {self.wall_s:.1f}s ({tps:.1f} tokens/s, {self.kernels} kernels) "
                f"-> {self.output}")


@dataclass(slots=True, eq=False)
class Stream:
    """One input and its output folder. `lane` is fixed for per-lane inputs, else chosen per row."""
    source: Source
    sink: ArrowSink
    lane: str | None
    key_salt: int = 0
    rows: Iterator[InputRow] | None = None
    exhausted: bool = False
    columns: OutputColumns = OutputColumns()  # the optional output columns: kept input columns, logprobs, completions


def sampling_params(cfg: JobConfig, max_tokens: int | None = None) -> SamplingParams:
    return cfg.sampling_defaults(max_tokens)


def lanes_of(cfg: JobConfig) -> list[Lane]:
    if not cfg.lanes:
        return [Lane()]
    return [Lane(lane["name"], lane.get("priority", 0), float(lane.get("weight", 1.0))) for lane in cfg.lanes]


def build_engine(cfg: JobConfig, loaded, device: str, dtype: torch.dtype) -> Engine:
    model = LlamaModel(loaded.config, loaded.weights, dtype, device, kernels=cfg.kernels, block_size=cfg.block_size)
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


CONTENT_HASH_WHOLE_BYTES = 64 << 20  # an input file up to this size is hashed whole; a larger one by samples:
CONTENT_SAMPLES = 64  # this many windows spread evenly over the file, the first and the last bytes included,
CONTENT_SAMPLE_BYTES = 64 << 10  # of this size (4 MiB read per huge file)
_content_hashes: dict[tuple, str] = {}  # (path, size, mtime_ns, inode) -> hash: a sharded run asks twice


def input_identity(path: Path, source: Source) -> dict:
    """The input as the job fingerprint knows it: the format, the columns, and each data file's name
    (under the input folder), size and content hash. By content, not by mtime or location: a copied,
    moved or touched input still resumes; a changed byte forces --restart (in a huge file, a changed
    size or a byte inside a sampled window)."""
    reader = getattr(source, "inner", source)  # a shard reads its whole input's files
    files = [[f.relative_to(path).as_posix() if path.is_dir() else f.name, f.stat().st_size, content_hash(f)]
             for f in reader.files]
    return {"format": source.format_name, "files": files, "columns": list(source.columns)}


def content_hash(file: Path) -> str:
    """SHA-256 of the file, or of CONTENT_SAMPLES windows of it when it is over CONTENT_HASH_WHOLE_BYTES."""
    import hashlib  # here, with the rest of the input fingerprint

    st = file.stat()
    key = (str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ino)
    if key in _content_hashes:
        return _content_hashes[key]
    with open(file, "rb") as f:
        if st.st_size <= CONTENT_HASH_WHOLE_BYTES:
            digest = "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()
        else:
            h = hashlib.sha256()
            last = max(st.st_size - CONTENT_SAMPLE_BYTES, 0)
            for i in range(CONTENT_SAMPLES):
                f.seek(last * i // max(CONTENT_SAMPLES - 1, 1))
                h.update(f.read(CONTENT_SAMPLE_BYTES))
            digest = f"sha256-sampled-{CONTENT_SAMPLES}x{CONTENT_SAMPLE_BYTES}:" + h.hexdigest()
    _content_hashes[key] = digest
    return digest


PARAM_FIELDS = ("prompt_column", "messages_column", "chat", "chat_template", "system_prompt", "keep_columns",
                "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "lanes", "lane_column",
                "min_tokens", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                "include_stop_str_in_output", "logprobs", "n")


def fingerprint(cfg: JobConfig, source: Source, input_path: str, loaded, dtype: torch.dtype) -> dict:
    params = {k: v for k, v in asdict(cfg).items() if k in PARAM_FIELDS}
    params["dtype"] = str(dtype).removeprefix("torch.")
    fp = {"batchjob": batchjob.__version__, "input": input_identity(Path(input_path), source),
          "model": loaded.identity, "params": params}
    if isinstance(source, ShardSource):
        fp["shard"] = source.info()
    return fp


class Job:
    def __init__(self, cfg: JobConfig, *, restart: bool = False, resources: contextlib.ExitStack | None = None):
        """`resources` holds what the job must give back however it ends (the output lock); without
        it the lock lives as long as the Job. `restart` deletes the folder's results first."""
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        out = Path(cfg.output)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"output: {out} is a file, not a folder; name a folder for the results")
        self.shard = ShardSpec.resolve(cfg.shard)
        if self.shard is None:
            check_unsharded(out)
        else:  # this process runs one slice of the input, into OUT/shard-K-of-N/
            if cfg.per_lane_inputs:
                raise ConfigError("shard: lanes with their own inputs cannot be sharded; shard each lane's input as its own job")
            out = out / self.shard.folder_name
        if cfg.per_lane_inputs:
            inputs = [(lane["input"], out / lane["name"], lane["name"]) for lane in cfg.lanes]
        else:
            inputs = [(cfg.input, out, None)]
        for path, _, lane in inputs:
            if not Path(path).exists():
                where = f"lanes.{lane}.input" if lane else "input"
                raise SourceError(f"input not found: {path} ({where} in {cfg.job_file})" if cfg.job_file
                                  else f"input not found: {path} (--input)")
        sources = [(open_source(path, input_format=cfg.input_format), path, folder, lane) for path, folder, lane in inputs]
        self.use_messages = {}
        self.empty_inputs = [path for source, path, *_ in sources if _is_empty(source, path)]
        for source, path, *_ in sources:
            uses = cfg.messages_column in source.columns
            if not uses and path not in self.empty_inputs:
                validate_columns(source, [cfg.prompt_column])
            if path not in self.empty_inputs:
                validate_columns(source, cfg.keep_columns)
            self.use_messages[id(source)] = uses
        template = _read_template(cfg.chat_template) if cfg.chat_template else None
        resolve_model_path(cfg.model)  # a mistyped model fails here, before an output folder is created
        device = choose_device(cfg.device)
        dtype = choose_dtype(cfg.dtype, device)
        # one writer per output folder (a shard's own folder) from before anything in it is touched
        created = [p for p in (out, *(folder for *_, folder, _ in sources)) if not p.exists()]
        self.lock = OutputLock(out)
        if resources is not None:
            resources.enter_context(self.lock)
        try:
            self._open(cfg, out, sources, restart, device, dtype, template)
        except BaseException:
            # nothing was committed: take back the folders this run created (they hold only the lock)
            self.lock.release()
            _remove_if_bare(created)
            raise

    def _open(self, cfg: JobConfig, out: Path, sources: list, restart: bool, device: str, dtype: torch.dtype,
              template: str | None) -> None:
        if restart:
            self._restart(out, [folder for _, _, folder, _ in sources])
        self.loaded = load_model(cfg.model, dtype=dtype)
        self.engine = build_engine(cfg, self.loaded, device, dtype)  # kernels chosen before any file is written
        if self.shard is not None:
            sources = [self._claim_shard(*sources[0], dtype)]
        if any(self.use_messages.values()) or cfg.chat:  # a broken template fails the job once, not every row
            check_chat_template(template or self.loaded.tokenizer.chat_template, cfg.chat_template or f"{self.loaded.name}'s chat template")
        self.builders = {key: PromptBuilder(cfg, self.loaded.tokenizer, uses, template) for key, uses in self.use_messages.items()}
        self.lane_column_out = bool(cfg.lanes) and not cfg.per_lane_inputs  # rows pick lanes: record it per row
        keep = list(cfg.keep_columns) + (["lane"] if self.lane_column_out else [])
        defaults = sampling_params(cfg)
        columns = {id(source): output_columns(keep, defaults, source.columns, source.format_name == OpenAIBatchSource.format_name)
                   for source, *_ in sources}
        self.streams = [
            Stream(source, ArrowSink(folder, fingerprint=fingerprint(cfg, source, path, self.loaded, dtype),
                                     keep_columns=columns[id(source)].names, part_rows=cfg.part_rows,
                                     part_seconds=cfg.part_seconds, total_rows=source.num_rows, part_format=cfg.part_format),
                   lane, key_salt=zlib.crc32(lane.encode()) if lane else 0, columns=columns[id(source)])
            for source, path, folder, lane in sources
        ]
        self.lanes = {lane.name: lane for lane in lanes_of(cfg)}
        self.params = {lane["name"]: sampling_params(cfg, lane.get("max_tokens")) for lane in cfg.lanes}
        self.default_params = sampling_params(cfg)
        self.in_flight: dict[int, tuple[Stream, int, dict]] = {}  # seq_id -> (stream, row_index, kept columns)
        self.pending: dict[int, tuple[PendingRow, int]] = {}  # seq_id -> (its row's completions, completion index)
        self.token_text = TokenText(self.loaded.tokenizer)
        self._next_seq = 0
        self.rows_in_flight = 0  # rows in the engine (a row with n > 1 completions counts once)
        self.one_token_stops = (0, 0)  # (rows finished without error, of those: ended at their first token)
        self.first_error: str | None = None
        self.stats = StatsRecorder(out / "stats.jsonl", kernels=self.engine.model.kernels.name)
        self.summary = JobSummary(output=str(out), kernels=self.engine.model.kernels.name)

    def _restart(self, out: Path, folders: list[Path]) -> None:
        """--restart: delete the committed results (parts, manifests, stats) and start over."""
        removed = 0
        for folder in {out, *folders}:
            removed += clear_results(folder)
            for name in ("stats.jsonl", RESULTS_FILE):
                if (folder / name).is_file():
                    (folder / name).unlink()
                    removed += 1
        print(f"batchjob: --restart: removed {removed} result files from {out}", file=sys.stderr)

    def _claim_shard(self, source: Source, path: str, folder: Path, lane: str | None, dtype: torch.dtype) -> tuple:
        """Swap the input for this shard's slice, after checking OUT/job.json (or writing it first)."""
        sliced = claim_shard(folder.parent, self.shard, source, fingerprint(self.cfg, source, path, self.loaded, dtype))
        self.use_messages[id(sliced)] = self.use_messages.pop(id(source))
        return sliced, path, folder, lane

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
        """Queue rows until `budget` rows wait in the engine: read a batch, tokenize it in one call, add
        each row's n Sequences; bad rows become error rows at once."""
        waiting = self.engine.scheduler.waiting
        queue_len = (lambda: len(waiting[stream.lane])) if stream.lane else (lambda: self.engine.scheduler.num_waiting)
        builder = self.builders[id(stream.source)]
        while not stream.exhausted and (room := budget - queue_len()) > 0:
            batch = []  # (row index, record, kept columns, lane)
            for _ in range(min(room, FEED_BATCH)):
                item = next(stream.rows, None)
                if item is None:
                    stream.exhausted = True
                    break
                record = item.record or {}
                kept = {c: record.get(c) for c in stream.columns.keep}
                if item.error:
                    self._emit(stream, item.row_index, kept, error=item.error)
                    continue
                try:
                    lane = self._lane_for(stream, record)
                except RowError as e:
                    self._emit(stream, item.row_index, kept, error=str(e))
                    continue
                if self.lane_column_out:
                    kept["lane"] = lane
                batch.append((item.row_index, record, kept, lane))
            for (row_index, record, kept, lane), ids in zip(batch, builder.token_ids_many([b[1] for b in batch])):
                try:
                    if isinstance(ids, RowError):
                        raise ids
                    params = row_sampling(record, self.params.get(lane, self.default_params))
                    stream.columns.check(params)
                except RowError as e:
                    self._emit(stream, row_index, kept, error=str(e))
                    continue
                self._add_row(stream, row_index, kept, lane, ids, params)

    def _add_row(self, stream: Stream, row_index: int, kept: dict, lane: str, ids: list[int], params: SamplingParams) -> None:
        row = PendingRow(params.n, stream.columns)
        self.rows_in_flight += 1
        for c in range(params.n):  # n completions: n Sequences, each with its own random stream
            seq_id = self._next_seq
            self._next_seq += 1
            key = sequence_key(params, self.cfg.seed ^ stream.key_salt, row_index, c)
            detok = IncrementalDetokenizer(self.loaded.tokenizer, ids, params.stop, min_tokens=params.min_tokens,
                                           include_stop_str_in_output=params.include_stop_str_in_output) if params.stop else None
            seq = Sequence(seq_id, ids, params, rng_key=key, lane=lane, detokenizer=detok)
            err = self.engine.add(seq)
            if err:  # the prompt never fits: the same for every completion
                self.rows_in_flight -= 1
                self._emit(stream, row_index, kept, error=err, prompt_tokens=len(ids))
                return
            self.in_flight[seq_id] = (stream, row_index, kept)
            self.pending[seq_id] = (row, c)

    # rows out

    def _emit(self, stream: Stream, row_index: int, kept: dict, *, text: str = "", reason: str = "error",
              prompt_tokens: int = 0, completion_tokens: int = 0, error: str | None = None, extra: dict | None = None) -> None:
        row = {"row_index": row_index, "generated_text": text, "finish_reason": reason,
               "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "error": error}
        row.update(kept)
        row.update(extra or {})
        stream.sink.write(row)
        s = self.summary
        s.rows += 1
        s.errors += reason == "error"
        s.prompt_tokens += prompt_tokens
        s.generated_tokens += completion_tokens
        if reason == "error":
            self.first_error = self.first_error or f"row {row_index}: {error}"
            self._check_errors()
        else:
            ok, first = self.one_token_stops
            self.one_token_stops = (ok + 1, first + (reason == "stop" and completion_tokens <= 1))

    def _check_errors(self, final: bool = False) -> None:
        """max_errors, over this run's rows and those committed before it."""
        rows, errors = self.before
        self.budget.check(errors + self.summary.errors, rows + self.summary.rows, final)

    def _finished(self, seq: Sequence) -> None:
        stream, row_index, kept = self.in_flight.pop(seq.seq_id)
        row, index = self.pending.pop(seq.seq_id)
        if row.add(index, seq, self.loaded.tokenizer, self.token_text):  # the row's last completion
            self.rows_in_flight -= 1
            self._emit(stream, row_index, kept, **row.fields())

    # the loop

    def run(self) -> JobSummary:
        cfg = self.cfg
        self.t0 = time.perf_counter()
        committed = [s.sink.manifest.totals() for s in self.streams]
        self.before = (sum(c["rows"] for c in committed), sum(c["errors"] for c in committed))
        self.summary.rows_before, self.summary.errors_before = self.before
        inputs = [s.source.num_rows for s in self.streams]
        total = None if None in inputs else sum(inputs)
        if total is not None and cfg.limit is not None:
            total = sum(min(n, cfg.limit) for n in inputs)
        self.summary.total_rows = total
        if self._already_finished():
            self.summary.already_finished = True
            return self.summary
        print(self._start_line(total), file=sys.stderr, flush=True)
        self.progress = self._progress(total)
        for stream in self.streams:
            stream.rows = self._rows(stream)
        self.budget = ErrorBudget(cfg.max_errors, total)
        read_ahead = cfg.read_ahead or 2 * cfg.max_num_seqs
        engine = self.engine
        self.dropped = 0  # rows read but put back by a stop
        stop = self.stop = StopSignals(cfg.drain_timeout, situation=self._stop_situation)
        stop.install()  # here, not at import: only a running job turns signals into a drain
        try:
            self._mark_run("running")
            try:
                self._check_errors()  # the rows committed before may be over the limit already
                draining = False
                while True:
                    if stop.stopping and not draining:
                        draining = True
                        self._drop_waiting()
                    if not draining:
                        for stream in self.streams:
                            self._feed(stream, read_ahead)
                    if not engine.has_work or (draining and stop.drain_over()):
                        break
                    finished = engine.step()
                    self.summary.generated_tokens_live += engine.last_stats.num_sampled
                    for seq in finished:
                        self._finished(seq)
                    self.stats.step(engine.last_stats, finished)
                    for stream in self.streams:
                        stream.sink.commit_if_due()
                    self.progress.update(self._snapshot())
                if not stop.stopping:
                    self._check_errors(final=True)
            except KeyboardInterrupt:  # a second Ctrl-C: stop at once, but say so in the manifests
                self._mark_run("stopped", signal="SIGINT (twice: at once)")
                raise
            except Exception as e:
                self._mark_run("failed", error=str(e))
                self._close_sinks()  # what finished is committed, if the disk lets us
                raise
            complete = not self.in_flight and not self.dropped and all(s.exhausted for s in self.streams)
            self.summary.stopped = None if complete else stop.received  # a signal after the last row changes nothing
            self._mark_run("stopped" if self.summary.stopped else "finished")
            for stream in self.streams:
                stream.sink.close()
                limited = cfg.limit is not None and stream.source.num_rows != stream.sink.done.count()
                if cfg.output_format == "openai-batch" and stream.exhausted and not self.summary.stopped and not limited:
                    write_openai_batch(stream.sink.out_dir)  # every row is in: the response file
        finally:
            stop.restore()
            self.progress.close()
        self.summary.wall_s = time.perf_counter() - self.t0
        self.summary.stats = self.stats.summary()
        self.stats.write(self.summary.stats)
        self.summary.empty_input = bool(self.empty_inputs) and self.summary.rows == 0 and not self.before[0]
        self._warn_if_chat_model_needs_chat()
        rows, errors = self.before[0] + self.summary.rows, self.before[1] + self.summary.errors
        if not self.summary.stopped and rows and errors == rows:
            raise AllRowsFailed(f"every row failed ({errors:,} of {rows:,}; committed in {self.summary.output}); "
                                f"the first error: {self.first_error or 'see the error column'}")
        return self.summary

    def _already_finished(self) -> bool:
        """Every input row committed (a rerun from cron or Slurm after the end): nothing to do."""
        for stream in self.streams:
            total = stream.sink.manifest.total_rows
            if total is None:
                return False
            if self.cfg.limit is not None:
                total = min(total, self.cfg.limit)
            if stream.sink.done.count() < total:
                return False
        return bool(self.streams) and not self.empty_inputs

    def _start_line(self, total: int | None) -> str:
        cfg, m = self.cfg, self.engine.model
        inputs = ", ".join(str(s.source.path) for s in self.streams)
        rows = f"{total:,} rows" if total is not None else "rows: not known until read"
        if cfg.limit is not None:
            rows += f" (--limit {cfg.limit:,})"
        line = (f"batchjob: {self.loaded.name} ({str(m.dtype).removeprefix('torch.')}, {m.kernels.name} kernels, "
                f"{m.device.type}, {torch.get_num_threads()} threads) <- {inputs}, {rows} -> {self.summary.output}")
        if self.before[0]:
            line += f"; resuming: {self.before[0]:,}" + (f" of {total:,}" if total is not None else "") + " rows committed"
        return line

    def _progress(self, total: int | None) -> Progress:
        total_bytes = bytes_before = None
        if total is None and len(self.streams) == 1:
            reader = getattr(self.streams[0].source, "inner", self.streams[0].source)
            if isinstance(reader, JsonlSource) and not isinstance(self.streams[0].source, ShardSource):
                total_bytes = reader.num_bytes  # of every file, for a folder of JSONL files
                resume = self.streams[0].sink.extra.get(RESUME_POSITION)
                bytes_before = int(resume[1]) if resume else 0
        return Progress(total_rows=total, rows_before=self.before[0], log_every=self.cfg.log_every,
                        enabled=self.cfg.progress, total_bytes=total_bytes, bytes_before=bytes_before or 0)

    def _snapshot(self) -> Snapshot:
        position = None
        if self.progress.total_bytes is not None:
            reader = getattr(self.streams[0].source, "inner", self.streams[0].source)
            position = reader.position()[1]
        s = self.summary
        return Snapshot(rows_done=self.before[0] + s.rows, rows_committed=self._committed_rows(),
                        rows_in_flight=self.rows_in_flight, tokens=s.generated_tokens_live, bytes_read=position)

    def _committed_rows(self) -> int:
        return sum(stream.sink.done.count() for stream in self.streams)

    def _stop_situation(self) -> str | None:
        """What a first Ctrl-C will do, when that is not a drain to exit 75: every row is already admitted."""
        if all(stream.exhausted for stream in self.streams) and not self.engine.scheduler.num_waiting:
            return (f"every row is admitted: finishing the {self.rows_in_flight:,} rows in flight, then the job "
                    f"ends as usual; SIGINT again stops at once (the rows in flight then run again on a rerun)")
        return None

    def _warn_if_chat_model_needs_chat(self) -> None:
        """Plain prompts into an instruct model often end at once: say that --chat is probably wanted."""
        ok, first = self.one_token_stops
        if self.cfg.chat or any(self.use_messages.values()) or self.loaded.tokenizer.chat_template is None:
            return
        if ok >= 4 and first / ok >= 0.5:
            print(f"batchjob: warning: {first:,} of {ok:,} rows ended at their first token; {self.loaded.name} has a "
                  f"chat template, so it probably expects chat input: rerun with --chat (each prompt becomes a user "
                  f"message) or give a `{self.cfg.messages_column}` column", file=sys.stderr, flush=True)

    def _rows(self, stream: Stream) -> Iterator[InputRow]:
        """The rows not committed yet. JSONL resumes at the byte offset of the first row not committed
        (the committed prefix is never read) and notes each row's offset for the next resume; Parquet
        and datasets inputs skip whole row groups / files instead."""
        limit = self.cfg.limit
        for item in self._rows_from(stream):
            if limit is not None and item.row_index >= limit:  # rows come in input order: the rest waits for a rerun
                return
            yield item

    def _rows_from(self, stream: Stream) -> Iterator[InputRow]:
        source, sink = stream.source, stream.sink
        reader = getattr(source, "inner", source)  # a shard reads through its inner source
        if not isinstance(reader, JsonlSource):
            unknown = source.num_rows is None  # a streamed input (CSV, compressed JSONL) counts its rows as it reads
            yield from source.rows(skip=sink.done)
            if unknown and reader.num_rows is not None:
                sink.set_total_rows(reader.num_rows)  # now known: `status` and `export` can tell what is missing
            return
        start = tuple(source.position())  # (0, 0), or where a shard begins
        resume = sink.extra.get(RESUME_POSITION)
        # valid only while every row before it is committed (a damaged part's rows must be read again)
        if resume and resume[0] > start[0] and sink.done.covers(start[0], resume[0]):
            start = (int(resume[0]), int(resume[1]))
        before = start
        for item in source.rows(skip=sink.done, start_offset=start):
            sink.note_position(item.row_index, list(before))
            yield item
            before = reader.position()
        if source.num_rows is None:
            sink.set_total_rows(before[0])  # now known: `status` and `export` can tell what is missing

    def _drop_waiting(self) -> None:
        """Stopping: rows that have not started go back to the input (rerun on resume)."""
        rows = set()
        for seq in self.engine.scheduler.drop_waiting():
            self.in_flight.pop(seq.seq_id, None)
            pending = self.pending.pop(seq.seq_id, None)
            if pending is not None:
                rows.add(id(pending[0]))
            self.dropped += 1
        self.rows_in_flight -= len(rows)

    def _mark_run(self, state: str, error: str | None = None, signal: str | None = None) -> None:
        """This run in each manifest (extra["run"]), for `batchjob status`: who, since when, how it ended."""
        for stream in self.streams:
            sink = stream.sink
            if state == "running":
                totals = sink.manifest.totals()
                run = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "kernels": self.summary.kernels,
                       "rows_at_start": totals["rows"], "completion_tokens_at_start": totals["completion_tokens"]}
            else:
                run = {**sink.extra.get("run", {}), "ended": time.time()}
            run["state"] = state
            if error:
                run["error"] = error[:1000]
            if state == "stopped":
                run["signal"] = signal or self.summary.stopped
            sink.set_extra("run", run)
            if state == "running" or signal:
                try:
                    sink.commit()  # at once: status shows this run before its first part / a hard stop as one
                except Exception:  # noqa: BLE001 - a hard stop must not fail on the way out
                    if state == "running":
                        raise

    def _close_sinks(self) -> None:
        for stream in self.streams:
            try:
                stream.sink.close()
            except Exception as e:  # e.g. the disk is still full: the rows run again on resume
                log.warning("could not commit the last rows of %s: %s", stream.sink.out_dir, e)


def _is_empty(source: Source, path: str) -> bool:
    """No rows at all: an input of 0 rows, or JSONL of blank lines (no columns either, so look at a row)."""
    if source.num_rows is not None:
        return source.num_rows == 0
    if source.columns:
        return False
    return next(iter(source.rows()), None) is None


def _read_template(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"chat_template: cannot read {path}: {e.strerror or e}") from None


def check_chat_template(template: str | None, name: str) -> None:
    from batchjob.models.chat import ChatTemplateError, compile_template

    if template is None:
        return  # rows say that the model has no template, one by one
    try:
        compile_template(template)
    except ChatTemplateError as e:
        raise ConfigError(f"chat_template: {name}: {e}") from None


def _remove_if_bare(folders: list[Path]) -> None:
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):  # innermost first
        try:
            lock = folder / ".lock"
            if lock.is_file() and {p.name for p in folder.iterdir()} == {".lock"}:
                lock.unlink()
            folder.rmdir()  # only when empty
        except OSError:
            pass


def run_job(cfg: JobConfig, *, restart: bool = False) -> JobSummary:
    with contextlib.ExitStack() as held:  # the output lock goes back however the job ends
        return Job(cfg, restart=restart, resources=held).run()
