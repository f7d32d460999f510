"""What every vision-language family's engine tests share: rows with images run through an Engine (greedy, 8 tokens
by default), transformers' greedy reference for one row, and a model saved by transformers loaded back through the
HF folder loader. Each family's test module brings its rows, its image slots and its reference inputs."""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from batchjob.engine.config import EngineConfig, SchedulerConfig
from batchjob.engine.engine import Engine
from batchjob.engine.requests import EngineRequest, SamplingParams
from batchjob.models.registry import build_model

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def engine_for(model, budget: int = 2048, block_size: int = 8, encoder_budget: int = 0, **config) -> Engine:
    return Engine(model, [], EngineConfig(num_blocks=256, block_size=block_size, **config,
                                          scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                                                    max_num_encoder_tokens=encoder_budget)))


def run_rows(engine: Engine, rows: list, slots: Callable, which: list[int], params: SamplingParams = GREEDY,
             errors: bool = False, images_per_step: list | None = None) -> tuple[list, int]:
    """Rows `which` of `rows` ((prompt ids, images) each; `slots(ids, images)` makes their ImageSlots) submitted
    together and run to the end: each row's output ids, in `which`'s order, and the prefix-cache hits on the way.
    `errors`: a row refused at submission or failed gives its error text instead (else it fails the test);
    `images_per_step`: gets the images each step encoded."""
    ids_of, out, hits = {}, {}, 0
    for i in which:
        ids, images = rows[i]
        got = engine.submit(EngineRequest(ids, params, seed=0, row_index=i, images=slots(ids, images)))
        if not isinstance(got, int):  # a Refusal
            assert errors, got
            out[i] = got.message
        else:
            ids_of[got] = i
    while engine.has_work:
        for r in engine.run_step():
            assert errors or r.error is None, r.error
            out[ids_of[r.request_id]] = list(r.output_ids) if r.error is None else r.error
        hits += engine.last_stats.prefix_hit_tokens if engine.last_stats else 0
        if images_per_step is not None and engine.last_stats:
            images_per_step.append(engine.last_stats.num_images)
    return [out[i] for i in which], hits


def hf_greedy(hf, ids: list[int], **images) -> list[int]:
    """transformers' greedy 8 tokens after `ids`, the images given as its model takes them."""
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False, **images)
    return out[0, len(ids):].tolist()


def saved_and_loaded(hf, tokenizer_dir: Path, folder: Path, architecture: str):
    """`hf` saved by transformers (with the tiny tokenizer beside it), loaded back by our HF folder loader: the model
    built from it (torch kernels), after checking the architecture it was read as."""
    from batchjob.models.loader import load_model

    hf.save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, folder / f.name)
    loaded = load_model(str(folder), dtype=torch.float32)
    assert loaded.config.architecture == architecture
    return loaded, build_model(loaded.config, loaded.weights, torch.float32, kernels="torch")
