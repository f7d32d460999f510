"""Greedy continuations of the tiny family models on the Triton kernels under the interpreter (set before triton is
imported, so this runs in its own process, started early beside the suite: tests/background.py). It builds the
models itself, with the suite's own builders (tests/conftest.py: the same bytes as the suite's folders), and prints
{arch: {"sha256": its weights' digest, "ids": [output ids per prompt]}} as JSON:

    python -m tests.models.triton_families PROMPTS_JSON MAX_TOKENS ARCH...
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # this module is run, never imported by the suite: it would set it there too

import torch  # noqa: E402

from batchjob.engine.core.scheduler import SchedulerConfig  # noqa: E402
from batchjob.engine.params import SamplingParams  # noqa: E402
from batchjob.engine.engine import Engine, EngineConfig  # noqa: E402
from batchjob.models import registry  # noqa: E402
from batchjob.models.loader import load_model  # noqa: E402


def main() -> None:
    from tests.builders import weights_digest
    from tests.conftest import write_tiny_model, write_tiny_tokenizer
    from tests.triton_interpreter import skip_repeated_patches

    skip_repeated_patches()

    prompts, n = json.loads(sys.argv[1]), int(sys.argv[2])
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tiny_tokenizer(Path(tmp))
        for arch in sys.argv[3:]:
            folder = Path(tmp) / arch
            folder.mkdir()
            write_tiny_model(folder, arch, tokenizer, tie_word_embeddings=arch.startswith("gemma"))
            loaded = load_model(str(folder), dtype=torch.float32)
            model = registry.build_model(loaded.config, loaded.weights, torch.float32, kernels="triton")
            assert model.kernels.name == "triton" and model.kernels.reference_ops() == ["argmax"]
            engine = Engine(model, [], EngineConfig(num_blocks=256, block_size=16,
                                                    scheduler=SchedulerConfig(max_num_batched_tokens=48)))
            ids = [s.output_ids for s in engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]
            out[arch] = {"sha256": weights_digest(folder), "ids": ids}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
