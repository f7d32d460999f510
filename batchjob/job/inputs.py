"""A job's inputs, found and checked before anything heavy starts (no torch here: job/process/preflight.py runs it before
torch is imported): each input path with its output folder and lane, opened, with the columns the job reads."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from batchjob.sharding.shards import ShardSpec, check_unsharded
from batchjob.errors import ConfigError
from batchjob.job.options.config import JobConfig
from batchjob.job.options.modes import Task
from batchjob.io.sources import Source, SourceError, open_source, validate_columns
from batchjob.tool_calls.requests import TOOLS_COLUMN

OpenedInput = tuple[Source, str, Path, str | None]  # (source, its path, its output folder, its lane)


def output_folder(cfg: JobConfig) -> tuple[Path, ShardSpec | None]:
    """The folder this process writes (a shard's OUT/shard-K-of-N/) and its shard, checked: the output is not a
    file, an unsharded run does not write into a sharded job's folder, per-lane inputs are not sharded."""
    out = Path(cfg.output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"output: {out} is a file, not a folder; name a folder for the results")
    shard = ShardSpec.resolve(cfg.shard)
    if shard is None:
        check_unsharded(out)
        return out, None
    if cfg.per_lane_inputs:
        raise ConfigError("shard: lanes with their own inputs cannot be sharded; shard each lane's input as its own job")
    return out / shard.folder_name, shard  # this process runs one slice of the input


def input_folders(cfg: JobConfig, out: Path) -> list[tuple[str, Path, str | None]]:
    """(input path, output folder, lane) per stream: one, or one per lane with its own input (OUT/<lane>/)."""
    if cfg.per_lane_inputs:
        inputs = [(lane["input"], out / lane["name"], lane["name"]) for lane in cfg.lanes]
    else:
        inputs = [(cfg.input, out, None)]
    for path, _, lane in inputs:
        if not Path(path).exists():
            where = f"lanes.{lane}.input" if lane else "input"
            raise SourceError(f"input not found: {path} ({where} in {cfg.job_file})" if cfg.job_file
                              else f"input not found: {path} (--input)")
    return inputs


def open_inputs(cfg: JobConfig, inputs: list[tuple[str, Path, str | None]]
                ) -> tuple[list[OpenedInput], dict[int, bool], list[str]]:
    """The sources, checked for the columns the job reads: (opened inputs, whether each source (by id)
    has the messages column, the paths of empty inputs)."""
    sources = [(open_source(path, input_format=cfg.input_format), path, folder, lane) for path, folder, lane in inputs]
    use_messages = {}
    empty_inputs = [path for source, path, *_ in sources if _is_empty(source, path)]
    for source, path, *_ in sources:
        uses = cfg.messages_column in source.columns
        if not uses and path not in empty_inputs:
            validate_columns(source, [cfg.prompt_column], fix="pass --prompt-column NAME (or --messages-column NAME "
                             "for chat messages) to read the prompt from another column")
        if path not in empty_inputs:
            validate_columns(source, cfg.keep_columns + ([cfg.id_column] if cfg.id_column not in (None, "none") else []))
            if cfg.image_column is not None:
                validate_columns(source, [cfg.image_column], fix="pass --image-column NAME naming the column with the "
                                 "rows' images")
        use_messages[id(source)] = uses
        source.check_task(cfg.task)
    chat = cfg.chat or cfg.image_column is not None or any(use_messages.values())
    if cfg.chat_template_kwargs and cfg.task == Task.GENERATE and not chat and len(empty_inputs) < len(sources):
        raise ConfigError(f"chat_template_kwargs: the rows are plain prompts (the input has no {cfg.messages_column!r} "
                          "column and the job is not --chat), which no chat template renders, so its variables would "
                          "be ignored; pass --chat (each prompt becomes a user message) or give the rows as messages")
    return sources, use_messages, empty_inputs


def _is_empty(source: Source, path: str) -> bool:
    """No rows at all: an input of 0 rows, or JSONL of blank lines (no columns either, so look at a row)."""
    if source.num_rows is not None:
        return source.num_rows == 0
    if source.columns:
        return False
    return next(iter(source.rows()), None) is None


def with_tool_parser(cfg: JobConfig, sources: list[OpenedInput]) -> JobConfig:
    """The job's options with `tool_parser` auto where it names none and its input carries tools (a `tools` column;
    an OpenAI Batch file's chat bodies with tools): their calls are read by the parser the chat template calls for,
    named on the start line (job/run.py), or the job stops at start when there is none (job/rows/tool_rows.py)."""
    if cfg.tool_parser is not None or cfg.task != Task.GENERATE:
        return cfg
    for source, *_ in sources:
        if source.carries_tools(TOOLS_COLUMN):
            return dataclasses.replace(cfg, tool_parser="auto")
    return cfg
