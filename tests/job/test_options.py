"""The options table (job/options/options.py): each option declared once, and what is made from it agrees with it."""
from __future__ import annotations

import dataclasses

import pytest

from batchjob import api
from batchjob.cli.run_options import RUN_OPTIONS
from batchjob.engine.requests import SamplingParams
from batchjob.job.options.config import TABLES, ConfigError, load_job
from batchjob.job.options.fingerprint import PARAM_FIELDS, WHEN_SET_FIELDS
from batchjob.job.options.modes import KernelChoice, Pooling, Preemption, Task
from batchjob.job.options.options import OPTIONS, SAMPLING_PARAMS, Api, Table


def test_the_sampling_options_are_the_sampling_parameters():
    # a row's own parameters (SamplingParams) and the job's sampling options are the same names: the job passes
    # its table's sampling options on by name (JobConfig.sampling_defaults)
    # a row's own seed; the job's own tables and task; bad_words' tokens (the row planner makes them from the words)
    row_only = {"seed", "structured_outputs", "pooling", "bad_words_token_ids"}
    assert set(SAMPLING_PARAMS) == {f.name for f in dataclasses.fields(SamplingParams)} - row_only
    assert load_job(None, {"input": "x", "min_p": 0.2, "stop_token_ids": "5, 7"}).sampling_defaults() == \
        SamplingParams(min_p=0.2, stop_token_ids=(5, 7))


def test_flags_tables_api_keywords_and_fingerprint_come_from_the_table():
    assert [o.field for o in RUN_OPTIONS] == [name for name, o in OPTIONS.items() if o.flag != ""]
    assert {name for names in TABLES.values() for name in names} == {n for n, o in OPTIONS.items() if o.table is not Table.JOB}
    assert api.ENGINE_OPTIONS == tuple(n for n, o in OPTIONS.items() if Api.ENGINE in o.api)
    assert "kernels" in api.ENGINE_OPTIONS and "temperature" in api.SAMPLING_OPTIONS and "pooling" in api.EMBED_OPTIONS
    assert "temperature" in PARAM_FIELDS and "max_model_len" in WHEN_SET_FIELDS and "threads" not in PARAM_FIELDS


def test_modes_are_enums_read_once_and_the_config_is_frozen():
    cfg = load_job(None, {"input": "x", "task": "embed", "pooling": "mean", "kernels": "torch", "preemption": "swap"})
    assert cfg.task is Task.EMBED and cfg.pooling is Pooling.MEAN and cfg.kernels is KernelChoice.TORCH
    assert cfg.preemption is Preemption.SWAP and cfg.task == "embed"  # a mode is also its text
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.task = Task.GENERATE
    with pytest.raises(ConfigError, match=r"task: 'embedding' is not one of generate, embed, score"):
        load_job(None, {"input": "x", "task": "embedding"})
    with pytest.raises(ConfigError, match=r"stop_token_ids: expected a list of integers"):
        load_job(None, {"input": "x", "stop_token_ids": "5, x"})


def test_an_option_added_later_leaves_an_older_jobs_fingerprint_as_it_was(tmp_path):
    # WHEN_SET options (allowed_token_ids, a list: its default is a factory's) enter the fingerprint only when set,
    # so a job written before they existed still resumes
    from batchjob.io.sources import open_source
    from batchjob.job.options.fingerprint import ModelFacts, fingerprint

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    facts = ModelFacts({"name": "m"}, "float32", "none")

    def params(**values):
        return fingerprint(load_job(None, {"input": str(src), **values}), open_source(src), str(src), facts)["params"]

    assert not set(WHEN_SET_FIELDS) & set(params())
    assert params(allowed_token_ids="5,7")["allowed_token_ids"] == [5, 7]
    assert params(kv_cache_dtype="int8")["kv_cache_dtype"] == "int8"
