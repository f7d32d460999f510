"""Fixtures of the durability tests: the tiny model, the inputs, and the uninterrupted runs' results."""
from __future__ import annotations

import pytest

from tests.durability.harness import cli, jsonl, result_texts
from tests.durability.jobs import CHAT, ROWS, job, responses


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama", max_positions=256)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    prompts = jsonl(folder / "in.jsonl", [{"prompt": f"Row {i} says"} for i in range(ROWS)])
    batch = jsonl(folder / "batch.jsonl", [{"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
                                             "body": {"model": "tiny", "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": f"Hello {i}"}]}}
                                            for i in range(ROWS // 2)])
    return prompts, batch


@pytest.fixture(scope="module")
def reference(model, inputs, tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    cli(job(model, inputs[0])(root))
    cli(job(model, inputs[1], "--output-format", "openai-batch", out="batch")(root))
    return result_texts(root / "out"), responses(root / "batch" / "results.jsonl")


