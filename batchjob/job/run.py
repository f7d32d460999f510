"""One run of a job: opens its streams, model and engine (Job.__init__), then runs the loop that feeds
rows to the engine, commits results and stops on a signal, and records the run in each manifest.

A job has one stream (one input, one output folder) or, with per-lane inputs, one stream per lane
(OUTPUT/<lane>/). Each stream reads ahead a bounded number of rows, so memory does not grow with
the number of rows."""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

from batchjob.errors import ConfigError
from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import OutputFormat, Task
from batchjob.job.rows.chat_templates import check_chat_template, read_template
from batchjob.job.feed import RowFeed
from batchjob.job.rows.embed_task import resolve_pooling
from batchjob.job.options.fingerprint import ModelFacts, fingerprint
from batchjob.job.process.heap import QuietCollector
from batchjob.sharding.shards import claim_shard
from batchjob.io.export import responses_written, write_openai_batch
from batchjob.io.lock import OutputLock
from batchjob.io.part_writer import OutputError
from batchjob.io.sink import RESUME_POSITION
from batchjob.io.sources import Source
from batchjob.job.engine_setup import engine_for
from batchjob.job.process.kept_models import ModelKeeper
from batchjob.job.rows.images import ImageRows
from batchjob.job.options.resolved import ResolvedJob
from batchjob.models.loader import resolve_model_path
from batchjob.job.process.preflight import rows_of_finished_run
from batchjob.job.report.progress import Progress, Snapshot
from batchjob.job.report.stats import StatsRecorder, peak_rss_bytes
from batchjob.job.error_budget import ErrorBudget, TooManyErrors, job_failure
from batchjob.job.process.signals import StopSignals
from batchjob.job.inputs import OpenedInput, input_folders, open_inputs, output_folder, with_tool_parser
from batchjob.job.rows.tool_rows import ToolRows
from batchjob.reasoning.parsers import job_parser
from batchjob.job.streams import clear_for_restart, open_streams, remove_bare_folders, uncommitted_rows
from batchjob.job.report.summary import ChatHint, JobSummary, start_line

log = logging.getLogger(__name__)
PEAK_RSS_EVERY = 10.0  # seconds between updates of a running job's peak RSS in its manifests


class Job:
    def __init__(self, cfg: JobConfig, *, restart: bool = False, resources: contextlib.ExitStack | None = None,
                 keeper: ModelKeeper | None = None):
        """`resources` holds what the job must give back however it ends (the output lock); without
        it the lock lives as long as the Job. `restart` deletes the folder's results first. `keeper`: models kept
        loaded from an earlier run in this process (a Ray actor's shards), used when they are this job's."""
        # a mistyped model fails here, before an output folder is created; an embed job's default pooling is the
        # model folder's
        self.cfg = cfg = resolve_pooling(cfg, resolve_model_path(cfg.model))
        self.resolved = job = ResolvedJob.of(cfg)  # device, dtype and threads: "auto" decided once
        torch.set_num_threads(job.threads)
        self.keeper = keeper
        # a signal (handlers installed by run()) or request() from the embedder: a Ray actor told to stop by the driver
        self.stop = StopSignals(cfg.drain_timeout, situation=self._stop_situation,
                                bar_shown=lambda: self.progress.bar is not None)
        out, self.shard = output_folder(cfg)
        sources, self.use_messages, self.empty_inputs = open_inputs(cfg, input_folders(cfg, out))
        # rows with tools and no --tool-parser: auto (its name on the start line, or the job stops at start)
        self.tools_implied = cfg.tool_parser is None
        self.cfg = cfg = with_tool_parser(cfg, sources)
        self.tools_implied &= cfg.tool_parser is not None
        # an unsharded job of empty inputs computes nothing: its folder records 0 rows, and no model loads
        self.nothing_to_compute = self.shard is None and len(self.empty_inputs) == len(sources)
        template = read_template(cfg.chat_template) if cfg.chat_template else None
        # one writer per output folder (a shard's own folder) from before anything in it is touched
        created = [p for p in (out, *(folder for *_, folder, _ in sources)) if not p.exists()]
        self.lock = OutputLock(out)
        if resources is not None:
            resources.enter_context(self.lock)
        try:
            self._open(cfg, out, sources, restart, job, template)
        except BaseException:
            # nothing was committed: take back the folders this run created (they hold only the lock)
            self.lock.release()
            remove_bare_folders(created)
            raise

    def _open(self, cfg: JobConfig, out: Path, sources: list[OpenedInput], restart: bool, job: ResolvedJob,
              template: str | None) -> None:
        if restart:
            clear_for_restart(out, [folder for _, _, folder, _ in sources])
        lane_column_out = bool(cfg.lanes) and not cfg.per_lane_inputs  # rows pick lanes: record it per row
        if self.nothing_to_compute:  # every input is empty: the model is described from its files, not loaded
            described = job.describe(cfg.model)
            self.reasoning, self.reasoning_name, self.tool_parser_name = None, None, None
            self.model_facts = ModelFacts(described.identity, job.dtype_name, job.quantization(described))
            self.streams = open_streams(cfg, sources, self.model_facts, lane_column_out)
            self.summary = JobSummary(output=str(out), kernels="none", prefill_only=cfg.task != Task.GENERATE)
            return
        # the models (loaded now, or kept from this process's last job) and an engine of the job's own; the kernels
        # are chosen before any file is written
        built = (self.keeper or ModelKeeper()).models(job)
        self.loaded = built.loaded
        self.engine = engine_for(cfg, self.loaded, built.model, built.draft)
        self.model_facts = ModelFacts(self.loaded.identity, job.dtype_name, job.quantization(self.loaded))
        images = ImageRows.of(self.loaded, resolve_model_path(cfg.model))  # None: a text-only model
        if images is None and cfg.image_column is not None:
            raise ConfigError(f"image_column: {self.loaded.name} is a text-only model; images need a vision-language "
                              "model (docs/guide/images.md)")
        if self.shard is not None:
            sources = [self._claim_shard(*sources[0])]
        if any(self.use_messages.values()) or cfg.chat or cfg.image_column is not None:  # a broken template fails the job once
            check_chat_template(template or self.loaded.tokenizer.chat_template, cfg.chat_template or f"{self.loaded.name}'s chat template")
        self.reasoning, self.reasoning_name = job_parser(cfg.reasoning_parser, self.loaded.tokenizer, template)
        tool_rows = ToolRows.of(cfg.tool_parser, self.loaded.tokenizer, template, implied=self.tools_implied,
                                reasoning_parser=cfg.reasoning_parser)
        self.tool_parser_name = None if tool_rows is None else tool_rows.parser
        self.streams = open_streams(cfg, sources, self.model_facts, lane_column_out)
        self.summary = JobSummary(output=str(out), kernels=self.engine.model.kernels.name,
                                  prefill_only=cfg.task != Task.GENERATE, model=self.loaded.name)
        served = {cfg.model, self.loaded.name, Path(cfg.model).name, Path(cfg.model).stem}
        for source, *_ in sources:
            self.summary.other_models.update(source.other_models(served))
        bases = {id(source): Path(path).parent for source, path, *_ in sources}  # relative image paths start here
        self.feed = RowFeed(cfg, self.loaded, self.engine, self.use_messages, template, lane_column_out, self.summary,
                            images, bases, self.reasoning, tool_rows)
        self.chat_hint = ChatHint(cfg, self.loaded, any(self.use_messages.values()))
        self.stats = StatsRecorder(out / "stats.jsonl", kernels=self.engine.model.kernels.name)

    def _parsers_said(self) -> str:
        """The start line's parsers: the names they resolved to, and how."""
        said, cfg = "", self.cfg
        if self.reasoning_name is not None:
            how = ["auto"] if cfg.reasoning_parser == "auto" else []
            if not (cfg.chat or cfg.image_column is not None or any(self.use_messages.values())):
                how.append("plain prompts: no chat template is applied; the model thinks where a prompt asks it to")
            said += f"; reasoning parser: {self.reasoning_name}" + (f" ({'; '.join(how)})" if how else "")
        if self.tool_parser_name is not None:
            how = " (auto: the rows carry tools)" if self.tools_implied else " (auto)" if cfg.tool_parser == "auto" else ""
            said += f"; tool parser: {self.tool_parser_name}{how}"
        return said

    def _claim_shard(self, source: Source, path: str, folder: Path, lane: str | None) -> OpenedInput:
        """Swap the input for this shard's slice, after checking OUT/job.json (or writing it first)."""
        sliced = claim_shard(folder.parent, self.shard, source, fingerprint(self.cfg, source, path, self.model_facts))
        self.use_messages[id(sliced)] = self.use_messages.pop(id(source))
        return sliced, path, folder, lane

    # the loop

    def run(self) -> JobSummary:
        cfg = self.cfg
        self.t0 = time.perf_counter()
        self._peak_rss_due = time.monotonic() + PEAK_RSS_EVERY
        committed = [s.sink.manifest.totals() for s in self.streams]
        self.before = (sum(c["rows"] for c in committed), sum(c["errors"] for c in committed))
        if self.nothing_to_compute:
            self._mark_run("running")
            self._mark_run("finished")
            for stream in self.streams:
                stream.sink.set_total_rows(0)  # known without reading: a JSONL input of blank lines too
                stream.sink.close()
            self.summary.empty_input = not self.before[0]
            return self.summary
        feed = self.feed
        feed.before = self.before
        self.summary.rows_before, self.summary.errors_before = self.before
        inputs = [s.source.num_rows for s in self.streams]
        total = None if None in inputs else sum(inputs)
        if total is not None and cfg.limit is not None:
            total = sum(min(n, cfg.limit) for n in inputs)
        self.summary.total_rows = total
        if self._already_finished():
            self.summary.already_finished = True
            failure = self._failure(*self.before, first_error=self._recorded_error(), rerun=True)
            if failure is not None:  # a rerun exits as the job did: cron and retry loops see the failure
                raise failure
            if cfg.output_format == OutputFormat.OPENAI_BATCH:
                for stream in self.streams:  # a crash after the last commit, before the response files: write them
                    limited = cfg.limit is not None and stream.sink.manifest.total_rows != stream.sink.done.count()
                    if not limited and not responses_written(stream.sink.out_dir):
                        write_openai_batch(stream.sink.out_dir)
            return self.summary
        line = start_line(cfg, self.loaded, self.engine.model, [str(s.source.path) for s in self.streams], total,
                          self.before[0], self.summary.output, self.engine.kv_pool)
        print(line + self._parsers_said(), file=sys.stderr, flush=True)
        self.progress = self._progress(total)
        for stream in self.streams:
            stream.rows = uncommitted_rows(stream, cfg.limit)
        feed.budget = ErrorBudget(cfg.max_errors, total)
        read_ahead = cfg.read_ahead_rows
        engine = self.engine
        stop = self.stop
        stop.install()  # here, not at import: only a running job turns signals into a drain
        collector = QuietCollector()
        collector.start()
        try:
            try:
                self._mark_run("running")  # inside: a disk that fails this first commit closes the sinks too
                feed.check_errors()  # the rows committed before may be over the limit already
                steps = feed.driver.steps(lambda: feed.refill(self.streams, read_ahead, stop.stopping),
                                        proceed=lambda: not (feed.draining and stop.drain_over()))
                for step in steps:
                    feed.finished(step)
                    finished = step.outputs
                    if finished and (hint := self.chat_hint.due(feed.one_token_stops)):
                        self.progress.say(hint)  # early: the operator may stop the job and rerun it with --chat
                    if engine.last_stats is not None:  # None: an async step was launched, none completed
                        st = engine.last_stats  # an embed or score job's rate: the prompt tokens it computes
                        self.summary.generated_tokens_live += st.num_tokens if self.summary.prefill_only else st.num_sampled
                        self.stats.step(engine.last_stats, finished)
                    self._note_peak_rss()
                    for stream in self.streams:
                        stream.sink.commit_if_due()
                    self.progress.update(self._snapshot())
                if not stop.stopping:
                    feed.check_errors(final=True)
            except KeyboardInterrupt:  # a second Ctrl-C: stop at once, but say so in the manifests
                self._mark_run("stopped", signal="SIGINT (twice: at once)")
                raise
            except Exception as e:
                if isinstance(e, OutputError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._record_disk_full()
                else:
                    self._mark_run("failed", error=str(e))
                self._close_sinks(e)  # what finished is committed, if the disk lets us
                raise
            complete = not feed.rows_in_flight and not feed.dropped and all(s.exhausted for s in self.streams)
            self.summary.stopped = None if complete else stop.received  # a signal after the last row changes nothing
            rows, errors = self.before[0] + self.summary.rows, self.before[1] + self.summary.errors
            failure = None if self.summary.stopped else self._failure(rows, errors, feed.first_error)
            if failure is not None:
                self._mark_run("failed", error=str(failure))
            else:
                self._mark_run("stopped" if self.summary.stopped else "finished")
            for stream in self.streams:
                stream.sink.close()
                limited = cfg.limit is not None and stream.source.num_rows != stream.sink.done.count()
                if cfg.output_format == OutputFormat.OPENAI_BATCH and stream.exhausted and not self.summary.stopped and not limited:
                    write_openai_batch(stream.sink.out_dir)  # every row is in: the response file
        finally:
            feed.close()  # the planning thread: a batch it was planning waits for it to end
            collector.stop()
            stop.restore()
            self.progress.close()
        self.summary.wall_s = time.perf_counter() - self.t0
        self.summary.stats = self.stats.summary()
        self.summary.peak_rss_bytes = self.summary.stats["peak_rss_bytes"]
        st = self.engine.structured_stats
        if st.rows or st.failed:  # structured outputs: what the grammars cost
            self.summary.stats["structured"] = {
                "rows": st.rows, "failed": st.failed, "compile_ms": round(st.compile_s * 1e3, 1),
                "mask_steps": st.mask_steps, "mask_ms_per_step": round(st.mask_s * 1e3 / max(st.mask_steps, 1), 2)}
        self.stats.write(self.summary.stats)
        self.summary.empty_input = bool(self.empty_inputs) and self.summary.rows == 0 and not self.before[0]
        hint = self.chat_hint.due(feed.one_token_stops, final=True)  # a short job's, unless said while it ran
        if hint:
            print(hint, file=sys.stderr, flush=True)
        if failure is not None:
            raise failure
        return self.summary

    def _failure(self, rows: int, errors: int, first_error: str | None, rerun: bool = False) -> TooManyErrors | None:
        return job_failure(self.cfg.max_errors, self.summary.total_rows, self.summary.output, rows, errors, first_error, rerun)

    def _recorded_error(self) -> str | None:
        """The first row error a failed run recorded (its message names it), for a rerun's verdict."""
        for stream in self.streams:
            error = (stream.sink.manifest.extra.get("run") or {}).get("first_error")
            if error:
                return error
        return None

    def _already_finished(self) -> bool:
        """Every input row committed (a rerun from cron or Slurm after the end): nothing to do."""
        for stream in self.streams:  # a --limit N trial run is finished once its first N rows are in
            if rows_of_finished_run(stream.sink.manifest.total_rows, stream.sink.done, self.cfg.limit) is None:
                return False
        return bool(self.streams) and not self.empty_inputs

    def _progress(self, total: int | None) -> Progress:
        total_bytes = bytes_before = None
        if total is None and len(self.streams) == 1:
            source = self.streams[0].source
            if source.seeks and source.whole is source:  # a JSONL input, whole: its bytes (of every file of a folder)
                total_bytes = source.num_bytes
                resume = self.streams[0].sink.extra.get(RESUME_POSITION)
                bytes_before = int(resume[1]) if resume else 0
        return Progress(total_rows=total, rows_before=self.before[0], log_every=self.cfg.log_every,
                        enabled=self.cfg.progress, total_bytes=total_bytes, bytes_before=bytes_before or 0)

    def _snapshot(self) -> Snapshot:
        position = None
        if self.progress.total_bytes is not None:
            position = self.streams[0].source.position()[1]  # a whole JSONL input (_progress)
        s = self.summary
        in_flight = self.feed.rows_in_flight
        return Snapshot(rows_done=self.before[0] + s.rows, rows_committed=self._committed_rows(),
                        rows_in_flight=in_flight, tokens=s.generated_tokens_live, bytes_read=position,
                        rows_read_ahead=min(in_flight, self.engine.num_waiting()))

    def _committed_rows(self) -> int:
        return sum(stream.sink.done.count() for stream in self.streams)

    def _stop_situation(self) -> str | None:
        """What a first Ctrl-C will do, when that is not a drain to exit 75: every row is already admitted."""
        if all(stream.exhausted for stream in self.streams) and not self.engine.num_waiting():
            return (f"every row is admitted: finishing the {self.feed.rows_in_flight:,} rows in flight, then the job "
                    f"ends as usual; SIGINT again stops at once (the rows in flight then run again on a rerun)")
        return None

    def _mark_run(self, state: str, error: str | None = None, signal: str | None = None) -> None:
        """This run in each manifest (extra["run"]), for `batchjob status`: who, since when, how it ended."""
        for stream in self.streams:
            sink = stream.sink
            if state == "running":
                totals = sink.manifest.totals()
                run = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "kernels": self.summary.kernels,
                       "rows_at_start": totals["rows"], "completion_tokens_at_start": totals["completion_tokens"]}
                if self.cfg.limit is not None:  # a trial run: `status` and `export` take its first N rows as the job
                    run["limit"] = self.cfg.limit  # (absent: no limit, as in manifests written before it was kept)
            else:  # the process's peak memory, for `status` (it says nothing for runs recorded before it was kept)
                run = {**sink.extra.get("run", {}), "ended": time.time(), "peak_rss_bytes": peak_rss_bytes()}
            run["state"] = state
            if error:
                run["error"] = error[:1000]
            if not self.nothing_to_compute and self.feed.first_error:
                run["first_error"] = self.feed.first_error[:1000]
            if state == "stopped":
                run["signal"] = signal or self.summary.stopped
            sink.set_extra("run", run)
            if state == "running" or signal:
                try:
                    sink.commit()  # at once: status shows this run before its first part / a hard stop as one
                except Exception:  # noqa: BLE001 - a hard stop must not fail on the way out
                    if state == "running":
                        raise

    def _note_peak_rss(self) -> None:
        """Every PEAK_RSS_EVERY seconds, the process's peak memory so far into each manifest's run record,
        stored with the next part: `status` shows a running (or killed) run's peak as of its last commit."""
        now = time.monotonic()
        if now < self._peak_rss_due:
            return
        self._peak_rss_due = now + PEAK_RSS_EVERY
        peak = peak_rss_bytes()
        for stream in self.streams:
            stream.sink.set_extra("run", {**stream.sink.extra.get("run", {}), "peak_rss_bytes": peak})

    def _record_disk_full(self) -> None:
        """A full disk stopped the job: say so in each manifest if one more small record fits, so `status`
        tells "stopped: disk full" from a crash."""
        for stream in self.streams:
            sink = stream.sink
            run = {**sink.extra.get("run", {}), "ended": time.time(), "state": "stopped",
                   "reason": f"disk full at row {sink.done.count():,}", "peak_rss_bytes": peak_rss_bytes()}
            sink.record_after_failure("run", run)

    def _close_sinks(self, raising: BaseException) -> None:
        for stream in self.streams:
            try:
                stream.sink.close()
            except Exception as e:  # e.g. the disk is still full: the rows run again on resume
                if e is not raising:  # the error on its way to the operator is said once, there
                    log.warning("could not commit the last rows of %s: %s", stream.sink.out_dir, e)


def run_job(cfg: JobConfig, *, restart: bool = False) -> JobSummary:
    with contextlib.ExitStack() as held:  # the output lock goes back however the job ends
        return Job(cfg, restart=restart, resources=held).run()
