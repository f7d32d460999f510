"""Greedy continuations of model folders on the Triton kernels under the interpreter (set before triton is
imported, so this runs in its own process): `python -m tests.models.triton_families PROMPTS_JSON FOLDER...`
prints {folder: [output ids per prompt]} as JSON."""
from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from batchjob.engine.core.scheduler import SchedulerConfig  # noqa: E402
from batchjob.engine.params import SamplingParams  # noqa: E402
from batchjob.engine.engine import Engine, EngineConfig  # noqa: E402
from batchjob.models import registry  # noqa: E402
from batchjob.models.loader import load_model  # noqa: E402


def main() -> None:
    prompts, n = json.loads(sys.argv[1]), int(sys.argv[2])
    out = {}
    for folder in sys.argv[3:]:
        loaded = load_model(folder, dtype=torch.float32)
        model = registry.build_model(loaded.config, loaded.weights, torch.float32, kernels="triton")
        assert model.kernels.name == "triton" and model.kernels.reference_ops() == ["argmax"]
        engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=16, scheduler=SchedulerConfig(max_num_batched_tokens=48)))
        out[folder] = [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
