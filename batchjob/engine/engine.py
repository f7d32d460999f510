"""Engine: submit requests (requests.py), call `step()` until idle. Each step is one scheduler decision, the KV
swaps it asks for, one forward and one sampling pass; rows that finish leave with their output and their
blocks return to the pool. Callers use this class (submit, never_fits, run_step, num_waiting,
drop_waiting_requests); tests and benchmarks may also add Sequences they built and read them back (`add`, `step`,
`generate`)."""
from __future__ import annotations

import hashlib

import time
from dataclasses import dataclass

from batchjob.engine.core.block_pool import BlockPool
from batchjob.engine.core.detokenizer import IncrementalDetokenizer
from batchjob.engine.core.cost_model import CostModel
from batchjob.engine.worker.kv_budget import pool_size
from batchjob.engine.worker.kv_cache import KVCache
from batchjob.engine.worker.executor import Executor
from batchjob.engine.worker.model_runner import ModelRunner, StepTokens
from batchjob.engine.worker.tensor_parallel import TensorParallelExecutor
from batchjob.engine.sample.row_keys import sequence_key
from batchjob.engine.config import EngineConfig
from batchjob.engine.core.scheduler import Scheduler, SchedulerConfig, Step
from batchjob.engine.core.scheduler_output import SchedulerOutput, WorkerView
from batchjob.engine.core.output import OutputProcessor
from batchjob.engine.requests import EngineRequest, RequestOutput
from batchjob.engine.params import Refusal, SamplingParams, invalid
from batchjob.engine.core.sequence import Sequence, SeqStatus
from batchjob.engine.spec_decode.draft import DraftProposer
from batchjob.engine.spec_decode.config import SpeculativeError, SpeculativeMethod
from batchjob.engine.spec_decode.ngram import NgramProposer
from batchjob.engine.structured.grammar import GrammarState
from batchjob.engine.structured.rows import StructuredRows
from batchjob.notices import notice
from batchjob.models.causal_lm import CausalLM


@dataclass(slots=True)
class StepStats:
    num_seqs: int
    num_tokens: int
    num_decode: int
    num_prefill_tokens: int
    num_finished: int
    num_preempted: int
    num_running: int
    num_waiting: int
    blocks_used: int
    blocks_free: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    step_s: float
    forward_s: float  # ModelRunner.run: inputs, forward, logits, sampling
    model_s: float = 0.0  # inside the model only (forward + logits)
    num_sampled: int = 0  # tokens generated (one per decode and last prompt chunk; 1 + accepted per speculating row)
    num_proposed: int = 0  # speculative tokens proposed and verified in this step
    num_accepted: int = 0  # of them, kept
    num_images: int = 0  # image placeholder runs encoded (an image, or a tile of one)
    encoder_s: float = 0.0  # in the image encoder (within model_s)
    num_images_cached: int = 0  # image placeholder runs whose encoder output came from the encoder cache


@dataclass(slots=True)
class _Pending:
    step: Step
    tokens: StepTokens
    t0: float  # when the step's engine work began (its StepStats.step_s runs from here to its collection)
    launch_s: float  # host time to prepare and launch the forward (and sampling)
    model_s: float
    images: int = 0  # placeholder runs encoded
    encoder_s: float = 0.0
    images_cached: int = 0  # placeholder runs read from the encoder cache


def add_placeholders(step: Step, tokens: StepTokens) -> None:
    """Each row that samples one token in the launched step counts a placeholder: its length is known
    before its id, so the scheduler can plan the next step with it; the step's output fills it in."""
    for i in tokens.single_rows():
        step.seqs[i].num_placeholders += 1


class Engine:
    def __init__(self, model: CausalLM, eos_token_ids: list[int], config: EngineConfig | None = None,
                 draft_model: CausalLM | None = None, tokenizer=None):
        """`draft_model`: the proposer of `--speculative draft` (its KV shares the pool's blocks and bytes).
        `tokenizer` (models/tokenizer.py): what structured outputs compile their grammars against."""
        config = config or EngineConfig()
        per_block = KVCache.bytes_per_block(model, config.block_size)
        if draft_model is not None:
            draft_model.fit_kernels(config.block_size)
            per_block += KVCache.bytes_per_block(draft_model, config.block_size)
        self.kv_pool = pool_size(model, config, per_block)  # its blocks, and how their number was chosen
        num_blocks = self.kv_pool.blocks
        num_host = config.num_host_blocks or config.swap_space_bytes // per_block
        self.model = model
        self.config = config  # read, never changed: derived limits live on the engine and its scheduler
        # each LoRA adapter's prefix-cache root: its rows' prefixes are keyed apart from the base model's and each other's
        digests = model.adapters.digests if model.adapters is not None else []
        self._lora_roots = [hashlib.sha256(b"lora\0" + d.encode()).digest() for d in digests]
        self.eos = frozenset(eos_token_ids)
        self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.enable_prefix_caching)
        self.host_pool = BlockPool(num_host, config.block_size) if num_host else None
        self.cost = CostModel(per_block)
        self.scheduler = Scheduler(config.scheduler or SchedulerConfig(), self.pool, self.host_pool,
                                   prefer_swap=self.cost.prefer_swap, context_len=model.config.max_position_embeddings,
                                   encoder_cache_tokens=config.encoder_cache_tokens)
        self.max_model_len = self.scheduler.max_model_len  # the context, capped at what the KV pool holds
        for m in (model, draft_model) if draft_model is not None else (model,):
            m.fit_context(self.max_model_len)
        graphs = None  # decode steps as CUDA graphs: (most rows in a step, the longest row)
        if config.cuda_graphs and model.device.type == "cuda" and model.parallel is None:
            if not model.kernels.captures_graphs:
                notice(f"CUDA graphs need the Triton kernels (the {model.kernels.name} kernels plan each step on the "
                       "host); decode steps run eagerly")
            else:
                graphs = (self.scheduler.config.max_num_seqs, self.max_model_len)
        self.structured = StructuredRows(tokenizer, model.config.vocab_size, overlap=model.device.type != "cpu")
        # the executor of the steps (engine/worker/executor.py): in process, the ModelRunner; for a model split over
        # tensor-parallel ranks, one that sends each step to the other ranks too
        if model.parallel is not None:
            if draft_model is not None:
                raise SpeculativeError("speculative 'draft' under tensor parallel is not implemented; use 'ngram'")
            self.runner: Executor = TensorParallelExecutor(model, num_blocks, config.block_size, num_host,
                                                           encoder_cache_tokens=config.encoder_cache_tokens)
        else:
            self.runner = ModelRunner(model, num_blocks, config.block_size, num_host, graphs=graphs,
                                      encoder_cache_tokens=config.encoder_cache_tokens)
        self.view = WorkerView()  # what the executor was sent of each row: each step sends it the difference
        self.last_step: Step | None = None
        self.last_stats: StepStats | None = None
        self._stop_sets: dict[int, tuple[SamplingParams, frozenset[int]]] = {}
        # a launched step whose tokens are not applied yet (async_scheduling: until the next step() call)
        self._pending: _Pending | None = None
        spec = config.speculative
        if spec is not None:
            spec.check()
        self.proposer = None
        if spec is not None and spec.method == SpeculativeMethod.NGRAM:
            self.proposer = NgramProposer(spec)
        elif spec is not None and spec.method == SpeculativeMethod.DRAFT:
            if draft_model is None:
                raise SpeculativeError("speculative 'draft': no draft model was given to the engine")
            self.proposer = DraftProposer(spec, draft_model, model, num_blocks, config.block_size)
        self.async_scheduling = model.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        self.outputs = OutputProcessor(self.scheduler, self.pool, self.eos, self.max_model_len, self.proposer)
        self._compiling: list[Sequence] = []  # structured rows whose grammar is still compiling
        self.tokenizer = tokenizer
        self._next_id = 1 << 40  # submitted requests' ids (apart from the ids of Sequences added as they are)

    def submit(self, request: EngineRequest) -> int | Refusal:
        """Queue a request: its id (the finished Sequence's `seq_id`), or why it can never run (nothing queued)."""
        seq = self._sequence(request)
        err = self.add(seq)
        return err if err else seq.seq_id

    def never_fits(self, request: EngineRequest) -> Refusal | None:
        """Why the request could never run here (too long for the context or the KV pool), or None; queues nothing."""
        return self.scheduler.never_fits(Sequence(-1, list(request.prompt_ids), request.params))

    def _sequence(self, request: EngineRequest) -> Sequence:
        p = request.params
        detok = None
        if p.stop:
            if self.tokenizer is None:
                raise ValueError("stop strings need the engine's tokenizer (Engine(..., tokenizer=...))")
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_ids, p.stop, min_tokens=p.min_tokens,
                                           include_stop_str_in_output=p.include_stop_str_in_output)
        self._next_id += 1
        return Sequence(self._next_id, request.prompt_ids, p, lane=request.lane, detokenizer=detok,
                        # a greedy row draws nothing: no key (1 us a row saved)
                        rng_key=0 if p.greedy else sequence_key(p, request.seed, request.row_index, request.completion),
                        images=request.images, lora=request.lora,
                        prefix_root=self._lora_roots[request.lora] if request.lora >= 0 else b"")

    def add(self, seq: Sequence) -> Refusal | None:
        """Queue a row. Returns why (and queues nothing) when the row can never run. A
        structured row waits outside the scheduler while its grammar compiles; one whose grammar fails
        to compile then finishes with reason "error" (`seq.error`) from `step`."""
        err = self.scheduler.never_fits(seq)
        if err is None and seq.images:
            err = self._images_error(seq)
        if err is None and not -1 <= seq.lora < len(self._lora_roots):
            err = invalid(f"lora slot {seq.lora}: the model has {len(self._lora_roots)} adapters")
        if err is None and seq.params.prefill_only and self.proposer is not None:
            err = invalid("an embed or scoring row cannot run with speculative decoding (it generates nothing)")
        if err is None and seq.params.structured_outputs is not None:
            state = self.structured.admit(seq)
            if state is GrammarState.PENDING:
                self._compiling.append(seq)
                return None
            if state is GrammarState.FAILED:
                err, seq.error = invalid(seq.error), None  # refused at once: the caller records the row's error
        if err is None:
            self._queue(seq)
        return err

    def _images_error(self, seq: Sequence) -> Refusal | None:
        """Why a row's images cannot run here: a text-only model, or placeholder runs outside the prompt or
        overlapping."""
        if self.model.image_encoder is None:
            return invalid("images: this model is a text-only model; images need a vision-language model")
        end = 0
        for k, img in enumerate(seq.images):
            if img.offset < end or img.length < 1 or img.offset + img.length > seq.num_prompt:
                return invalid(f"images: image {k}'s placeholders ({img.offset}..{img.offset + img.length}) overlap "
                               f"another's or run past the prompt ({seq.num_prompt} tokens)")
            end = img.offset + img.length
        return None

    def _queue(self, seq: Sequence) -> None:
        p = seq.params
        stops = self._stop_sets.get(id(p))
        if stops is None or stops[0] is not p:  # rows mostly share one params object: one set for all
            stops = self._stop_sets[id(p)] = (p, frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos))
            if len(self._stop_sets) > 4096:
                self._stop_sets.clear()
        seq.stop_token_set = stops[1]
        self.scheduler.add(seq)

    def _admit_compiled(self) -> list[Sequence]:
        """Rows whose grammar finished compiling go to the scheduler; those whose grammar failed finish."""
        if not self._compiling:
            return []
        if not self.scheduler.has_work and self._pending is None:  # nothing else to run: wait for a grammar
            self.structured.wait_compile(self._compiling, timeout=0.5)
        waiting, failed = [], []
        for seq in self._compiling:
            state = self.structured.admit(seq)
            if state is GrammarState.PENDING:
                waiting.append(seq)
            elif state is GrammarState.READY:
                self._queue(seq)
            else:  # the compiler's message is in seq.error
                seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
                failed.append(seq)
        self._compiling = waiting
        return failed

    @property
    def has_work(self) -> bool:
        return self._pending is not None or self.scheduler.has_work or bool(self._compiling)

    def num_waiting(self, lane: str | None = None) -> int:
        """Rows waiting in the scheduler or for their grammar: in one lane, or in all."""
        if lane is None:
            return self.scheduler.num_waiting + len(self._compiling)
        return len(self.scheduler.waiting[lane]) + sum(s.lane == lane for s in self._compiling)

    @property
    def structured_stats(self):
        """What the structured-outputs rows cost so far (engine/structured/rows.py StructuredStats)."""
        return self.structured.stats

    def run_step(self) -> list[RequestOutput]:
        """One `step`; the requests that finished in it, as RequestOutputs (what the job and the API drive)."""
        return [RequestOutput.of(seq) for seq in self.step()]

    def drop_waiting_requests(self) -> list[int]:
        """`drop_waiting`, as the ids of the requests taken back."""
        return [seq.seq_id for seq in self.drop_waiting()]

    def drop_waiting(self) -> list[Sequence]:
        """Take back the waiting rows that never started (a stopping job lets only started rows finish)."""
        compiling, self._compiling = self._compiling, []
        dropped = self.scheduler.drop_waiting() + compiling
        self._release([s.seq_id for s in dropped])  # a row preempted before it is dropped was sent to the executor
        return dropped

    def _release(self, seq_ids: list[int]) -> None:
        self.view.release(seq_ids)
        self.runner.release(seq_ids)

    def step(self) -> list[Sequence]:
        """Run one iteration; returns the rows that finished in it. With `async_scheduling` (on CUDA) step N+1
        is scheduled and launched while step N still runs on the GPU, and the call then collects N and
        returns the rows N finished: the host's scheduling, input preparation and the caller's work on
        those rows overlap the GPU. A row whose token from N is not back yet is scheduled with a
        placeholder that the GPU fills from N's sampled ids (ModelRunner); a row that N finishes wastes
        one token of N+1, as in vLLM's async scheduling. Steps follow one another synchronously when a
        row in flight has penalties (they count the tokens before each position) or speculation is on.
        `last_step`/`last_stats` describe the step this call collected (None if it collected none)."""
        self.last_step = self.last_stats = None
        prev, finished = self._pending, self._admit_compiled()
        if prev is not None and not self._can_overlap(prev):
            finished, prev = self._collect(prev), None
        self._pending = None
        t_step = time.perf_counter()  # this step's own work starts here
        sched = self.scheduler
        if self.proposer is not None:  # never with a step in flight (_can_overlap): proposals read the tokens
            self.proposer.propose(sched.running, self.max_model_len)
        step = sched.schedule()
        if self.proposer is not None:
            self.proposer.fill(step)  # a draft model proposes into what the scheduler granted
        if step.swap_out or step.swap_in:
            ts = time.perf_counter()
            moved = self.runner.swap(step.swap_out, step.swap_in)
            self.cost.observe_swap(moved, time.perf_counter() - ts)
        launched = None
        if step:
            tf = time.perf_counter()
            model_before, enc = self.runner.model_s, self.runner.encoder
            images_before, encoder_before, cached_before = enc.images, enc.seconds, enc.cached
            out = self._output(step)
            tokens = self.runner.run(out) if prev is None else self.runner.run(out, prev.tokens)
            launched = _Pending(step, tokens, t_step, time.perf_counter() - tf, self.runner.model_s - model_before,
                                enc.images - images_before, enc.seconds - encoder_before, enc.cached - cached_before)
            add_placeholders(step, tokens)
            sched.advance(step)
        elif prev is None and sched.num_waiting and not sched.running:
            raise RuntimeError("scheduler made no progress with an empty batch (a row cannot be admitted)")
        if prev is not None:
            finished += self._collect(prev)
        if launched is not None and not self.async_scheduling:
            finished += self._collect(launched)
        else:
            self._pending = launched
        if not step and self.last_stats is None:  # nothing ran or was collected
            self._record(step, [], 0, time.perf_counter() - t_step, 0.0, 0.0)
        return finished

    def _output(self, step: Step) -> SchedulerOutput:
        """The step as the executor is sent it, with the structured rows' mask started for its sampled positions."""
        out = self.view.output(step)
        if self.structured.stats.rows:  # a row with a grammar was admitted
            sampling = [(seq, k) for seq, k in zip(step.seqs, out.num_sampled) if k]
            if sampling:
                out.grammar = self.structured.start_mask([seq for seq, _ in sampling], [n for _, n in sampling])
        return out

    def _can_overlap(self, pending: _Pending) -> bool:
        # penalties and bans read the tokens before each position, and a grammar's mask needs the row's last token
        return self.async_scheduling and self.proposer is None and not any(
            s.params.reads_output or s.matcher is not None for s in pending.step.seqs)

    def _collect(self, pending: _Pending) -> list[Sequence]:
        """Wait for a launched step's tokens and apply them to its rows (engine/core/output.py)."""
        step = pending.step
        tw = time.perf_counter()
        tokens = pending.tokens.tolist()
        embeddings = pending.tokens.embeddings()
        scored = pending.tokens.prompt_logprobs()
        logprobs = pending.tokens.logprobs()
        forward_s = pending.launch_s + time.perf_counter() - tw
        self.cost.observe_forward(step.num_tokens, forward_s)
        applied = self.outputs.apply(step, tokens, embeddings, scored, logprobs)
        self._release([s.seq_id for s in applied.finished])
        self._record(step, applied.finished, applied.num_sampled, time.perf_counter() - pending.t0, forward_s,
                     pending.model_s, applied.num_proposed, applied.num_accepted, pending.images, pending.encoder_s,
                     pending.images_cached)
        return applied.finished

    def _record(self, step: Step, finished: list[Sequence], sampled: int, step_s: float, forward_s: float,
                model_s: float, proposed: int = 0, accepted: int = 0, images: int = 0, encoder_s: float = 0.0,
                images_cached: int = 0) -> None:
        sched = self.scheduler
        num_decode = sum(1 for n in step.num_new if n == 1)
        self.last_step = step
        self.last_stats = StepStats(
            num_seqs=len(step.seqs), num_tokens=step.num_tokens, num_decode=num_decode,
            num_prefill_tokens=step.num_tokens - num_decode, num_finished=len(finished),
            num_preempted=len(step.preempted), num_running=len(sched.running), num_waiting=sched.num_waiting,
            blocks_used=self.pool.num_used, blocks_free=self.pool.num_free,
            prefix_hit_tokens=step.prefix_hit_tokens, prefix_query_tokens=step.prefix_query_tokens,
            step_s=step_s, forward_s=forward_s, model_s=model_s, num_sampled=sampled,
            num_proposed=proposed, num_accepted=accepted, num_images=images, encoder_s=encoder_s,
            num_images_cached=images_cached,
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], seed: int = 0) -> list[Sequence]:
        """Convenience for tests and benchmarks: run prompts to completion, return sequences in input order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(i, list(p), plist[i], rng_key=sequence_key(plist[i], seed, i)) for i, p in enumerate(prompts)]
        for s in seqs:
            if self.add(s):
                s.status, s.finish_reason = SeqStatus.FINISHED, "error"
        while self.has_work:
            self.step()
        return seqs
