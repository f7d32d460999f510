"""The systems under test. Each runner takes a model folder and a workload and returns a `RunResult`:
per-row output token counts and token times, generation wall time, and system-specific extras.

Runners run inside a bench worker process (`batchjob.bench.worker`), one process per system and model,
so peak RSS and start-up time belong to that system alone."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from batchjob.bench.workloads import Workload

SYSTEMS = ["batchjob", "batchjob-torch", "batchjob-static16", "batchjob-static64", "hf-static16", "hf-static64",
           "hf-continuous", "vllm"]  # batchjob-torch: continuous, on the torch reference kernels
OPTIONAL_SYSTEMS = ["hf-static16-bf16", "hf-static64-bf16", "hf-continuous-bf16",  # run when named in --systems
                    "batchjob-int8"]  # continuous, --quantization int8 (bench/int8_speed.py runs it beside batchjob)


@dataclass(slots=True)
class RunResult:
    useful_tokens: int  # the rows' own max_tokens, summed: what tokens/s counts
    counted: list[int]  # per row: output tokens it produced, capped at its max_tokens
    token_times: list[list[float]]  # per row: seconds since generation start at which each counted token appeared
    gen_s: float
    computed_tokens: int = 0  # output positions the system computed, padding included (static batches)
    extra: dict = field(default_factory=dict)


def _counted(workload: Workload, produced: list[int]) -> list[int]:
    return [min(n, r.max_tokens) for n, r in zip(produced, workload.rows)]


# ---- batchjob --------------------------------------------------------------------------------------


class BatchjobRunner:
    """Our Engine, driven directly (no files): continuous batching, or static batches of `static` rows."""

    def __init__(self, model_path: str, static: int = 0, dtype: str | None = None, kernels: str = "auto",
                 quantization: str = "none"):
        from batchjob.device import choose_dtype
        from batchjob.models.registry import build_model
        from batchjob.models.loader import load_model

        self.dtype = choose_dtype(dtype, "cpu")
        loaded = load_model(model_path, dtype=self.dtype)
        self.model = build_model(loaded.config, loaded.weights, self.dtype, kernels=kernels, quantization=quantization)
        self.kernels = self.model.kernels.name + ("" if quantization == "none" else f", {quantization} matmuls")
        self.eos = loaded.tokenizer.eos_token_ids
        self.static = static
    def _engine(self):
        from batchjob.engine.engine import Engine, EngineConfig
        from batchjob.engine.core.scheduler import SchedulerConfig

        sched = SchedulerConfig()  # the CLI's defaults: max_num_seqs 128, max_num_batched_tokens 2048
        if self.static:
            # as `batchjob run --scheduling static`: a batch is prefilled whole, then decoded to its longest row
            sched.static_batch = self.static
            sched.max_num_batched_tokens = 1 << 20
        return Engine(self.model, self.eos, EngineConfig(scheduler=sched))

    def run(self, workload: Workload) -> RunResult:
        from batchjob.engine.sample.row_keys import row_key
        from batchjob.engine.params import SamplingParams
        from batchjob.engine.core.sequence import Sequence

        engine = self._engine()
        seqs = [Sequence(i, list(r.prompt), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True), rng_key=row_key(0, i))
                for i, r in enumerate(workload.rows)]
        times: list[list[float]] = [[] for _ in seqs]
        steps: list[tuple] = []
        t0 = time.perf_counter()
        for s in seqs:
            err = engine.add(s)
            if err:
                raise RuntimeError(f"row {s.seq_id}: {err}")
        while engine.has_work:
            engine.step()
            now = time.perf_counter() - t0
            st = engine.last_stats
            if st is None:  # an async step launched, none completed (CUDA)
                continue
            for s in engine.last_step.seqs:
                while len(times[s.seq_id]) < s.num_output:
                    times[s.seq_id].append(now)
            steps.append((st.num_seqs, st.num_tokens, st.num_decode, st.step_s, st.forward_s, st.model_s,
                          st.prefix_hit_tokens, st.num_preempted))
        gen_s = time.perf_counter() - t0
        return RunResult(workload.useful_tokens, _counted(workload, [s.num_output for s in seqs]), times, gen_s,
                         computed_tokens=sum(s.num_output for s in seqs), extra=_engine_extra(steps))


def _engine_extra(steps: list[tuple]) -> dict:
    """Step statistics: the mean batch, and the share of step time spent outside the model forward."""
    def share(rows):
        step_s = sum(r[3] for r in rows)
        if not step_s:
            return None
        return {"steps": len(rows), "outside_model_forward": 1 - sum(r[5] for r in rows) / step_s,
                "outside_runner": 1 - sum(r[4] for r in rows) / step_s}

    at64 = [r for r in steps if r[0] == 64]
    hist: dict[str, int] = {}  # "num_seqs,num_tokens" -> steps: enough to rebuild the matmul ceiling step by step
    for r in steps:
        key = f"{r[0]},{r[1]}"
        hist[key] = hist.get(key, 0) + 1
    return {
        "steps": len(steps),
        "mean_seqs_per_step": sum(r[0] for r in steps) / max(1, len(steps)),
        "mean_tokens_per_step": sum(r[1] for r in steps) / max(1, len(steps)),
        "decode_steps_mean_seqs": _mean([r[0] for r in steps if r[2] == r[0]]),
        "step_s": sum(r[3] for r in steps),
        "runner_s": sum(r[4] for r in steps),
        "model_forward_s": sum(r[5] for r in steps),
        "share": share(steps),
        "share_at_64": share(at64),
        "prefix_hit_tokens": sum(r[6] for r in steps),
        "preemptions": sum(r[7] for r in steps),
        "step_histogram": hist,
    }


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ---- HF transformers -------------------------------------------------------------------------------


def _hf_model(model_path: str, dtype: torch.dtype):
    import transformers as tf

    tf.logging.set_verbosity_error()
    return tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


class HFStaticRunner:
    """`generate` over static batches of `batch` rows in input order, left-padded; each batch runs to its
    longest row (max_new_tokens = min_new_tokens = the batch's largest max_tokens, no EOS stop)."""

    def __init__(self, model_path: str, batch: int, dtype: torch.dtype = torch.float32):
        self.model = _hf_model(model_path, dtype)
        self.batch = batch
        self.dtype = dtype

    def run(self, workload: Workload) -> RunResult:
        import transformers as tf

        rows = workload.rows
        times: list[list[float]] = [[] for _ in rows]
        computed = 0
        pad = 0

        class Clock(tf.StoppingCriteria):  # called once per generated position: stamps it, never stops
            def __init__(self):
                self.stamps: list[float] = []

            def __call__(self, input_ids, scores, **kwargs):
                self.stamps.append(time.perf_counter() - t0)
                return torch.zeros(input_ids.shape[0], dtype=torch.bool)

        t0 = time.perf_counter()
        for start in range(0, len(rows), self.batch):
            chunk = rows[start:start + self.batch]
            width = max(len(r.prompt) for r in chunk)
            ids = torch.full((len(chunk), width), pad, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, r in enumerate(chunk):
                ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[i, width - len(r.prompt):] = 1
            g = max(r.max_tokens for r in chunk)
            cfg = tf.GenerationConfig(max_new_tokens=g, min_new_tokens=g, do_sample=False, eos_token_id=None,
                                      pad_token_id=pad, bos_token_id=None)
            clock = Clock()
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg,
                                          stopping_criteria=tf.StoppingCriteriaList([clock]))
            produced = out.shape[1] - width
            computed += produced * len(chunk)
            for i, r in enumerate(chunk):
                times[start + i] = clock.stamps[:min(produced, r.max_tokens)]
        gen_s = time.perf_counter() - t0
        return RunResult(workload.useful_tokens, [len(t) for t in times], times, gen_s, computed_tokens=computed)


class HFContinuousRunner:
    """transformers' continuous batching (`init_continuous_batching`), one request per row with its own
    max_new_tokens and EOS disabled. On CPU its KV cache is sized explicitly (it would size it from host RAM)."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32, num_blocks: int = 0,
                 max_batch_tokens: int = 2048):
        self.model = _hf_model(model_path, dtype)
        self.dtype = dtype
        self.num_blocks = num_blocks
        self.max_batch_tokens = max_batch_tokens

    def run(self, workload: Workload) -> RunResult:
        import transformers as tf

        page = 256
        longest = max(len(r.prompt) + r.max_tokens for r in workload.rows)
        # enough pages for every row at once (no eviction), as our engine's 1 GiB default allows
        blocks = self.num_blocks or sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in workload.rows) + 8
        cb = tf.ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=self.max_batch_tokens,
                                         max_blocks_per_request=-(-longest // page) + 1, max_requests_per_batch=128)
        gen = tf.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=1)
        rows = workload.rows
        results = {}
        with torch.inference_mode():
            manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
            manager.start()
            try:
                t0 = time.perf_counter()
                for i, r in enumerate(rows):
                    manager.add_request(list(r.prompt), request_id=f"r{i}", max_new_tokens=r.max_tokens,
                                        eos_token_id=-1, record_timestamps=True)
                while len(results) < len(rows):
                    out = manager.get_result(timeout=1)
                    if out is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers continuous batching stopped before finishing")
                        continue
                    if out.is_finished():
                        if out.error:
                            raise RuntimeError(f"transformers continuous batching: {out.request_id}: {out.error}")
                        results[out.request_id] = out
                gen_s = time.perf_counter() - t0
            finally:
                manager.stop(block=True, timeout=10)
                self.model.destroy_cached_continuous_batching_manager()
        produced, times = [], []
        for i in range(len(rows)):
            out = results[f"r{i}"]
            n = min(len(out.generated_tokens), rows[i].max_tokens)
            produced.append(len(out.generated_tokens))
            times.append([t - t0 for t in (out.timestamps or [])[:n]])
        return RunResult(workload.useful_tokens, _counted(workload, produced), times, gen_s,
                         computed_tokens=sum(produced))


def make_runner(system: str, model_path: str):
    """system name -> runner (loads the model). vLLM is not here: it runs in its own venv (see vllm.py)."""
    bf16 = system.endswith("-bf16")
    base = system.removesuffix("-bf16")
    hf_dtype = torch.bfloat16 if bf16 else torch.float32
    if base == "batchjob":
        return BatchjobRunner(model_path)
    if base == "batchjob-int8":
        return BatchjobRunner(model_path, quantization="int8")
    if base == "batchjob-torch":
        return BatchjobRunner(model_path, kernels="torch")
    if base.startswith("batchjob-static"):
        return BatchjobRunner(model_path, static=int(base.removeprefix("batchjob-static")))
    if base.startswith("hf-static"):
        return HFStaticRunner(model_path, int(base.removeprefix("hf-static")), hf_dtype)
    if base == "hf-continuous":
        return HFContinuousRunner(model_path, hf_dtype)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS + OPTIONAL_SYSTEMS)}")
