"""Speculative decoding with a draft model (`--speculative draft --draft-model PATH`): a smaller model
with the target's vocabulary proposes k tokens per decoding row, which the target verifies exactly as
it verifies prompt lookups (engine/spec_decode/ngram.py), so the text is the target's own.

Before scheduling, each eligible row reserves k proposals (placeholders); the scheduler grants them
budget and free blocks; then the draft fills them in: it first catches its KV cache up with the row's
tokens (a prefill of what it has not seen), then runs k one-token steps, each sampled with the row's own
random key at that output position, so a draft close to the target proposes what the target will draw.
The draft's KV lives in its own tensors but under the target's block ids (same pool, same tables), so
it needs no allocator of its own: `spec_state.computed` counts the positions it holds, never more than
the target has verified, and restarts at 0 when the row is preempted (its blocks were dropped or moved)."""
from __future__ import annotations

import torch

from batchjob.engine.sample import sampler
from batchjob.engine.worker.input_batch import CachedRow, flatten
from batchjob.engine.worker.model_runner import ModelRunner
from batchjob.engine.core.scheduler import Step
from batchjob.engine.core.sequence import Sequence
from batchjob.engine.spec_decode.config import SpeculativeConfig, SpeculativeError
from batchjob.engine.spec_decode.ngram import NgramProposer
from batchjob.models.step_context import StepContext


UNFILLED = -1  # a proposal slot the draft model has not filled yet


class DraftProposer(NgramProposer):
    def __init__(self, config: SpeculativeConfig, draft_model, target_model, num_blocks: int, block_size: int):
        super().__init__(config)
        if draft_model.config.vocab_size != target_model.config.vocab_size:
            raise SpeculativeError(f"draft model: vocabulary of {draft_model.config.vocab_size} tokens, the target's "
                                   f"has {target_model.config.vocab_size}; a draft model must share the target's tokenizer")
        self.model = draft_model
        self.runner = ModelRunner(draft_model, num_blocks, block_size)  # its KV tensors, under the target's block ids
        self.block_size = block_size

    def _lookup(self, tokens, state, k: int) -> list[int]:
        return [UNFILLED] * k  # filled by fill() once the scheduler has granted them

    def fill(self, step: Step) -> None:
        rows = [s for s in step.seqs if s.draft]
        if not rows:
            return
        for seq in rows:
            state = self.state(seq)
            if state.preemptions != seq.num_preemptions:
                state.computed, state.preemptions = 0, seq.num_preemptions  # its blocks are new: nothing held
        behind = [s for s in rows if self.state(s).computed < s.num_tokens - 1]
        if behind:  # catch up: the tokens it has not seen, but the last (the first draft step reads it)
            done = {id(s): self.state(s).computed for s in behind}
            self._forward([(s.token_ids[done[id(s)]:s.num_tokens - 1], done[id(s)], s.block_table)
                           for s in sorted(behind, key=lambda s: s.num_tokens - 1 - done[id(s)] != 1)])
            for s in behind:
                self.state(s).computed = s.num_tokens - 1
        for j in range(max(len(s.draft) for s in rows)):
            active = [s for s in rows if len(s.draft) > j]
            inputs = [(s.token_ids[-1] if j == 0 else s.draft[j - 1], s.num_tokens - 1 + j) for s in active]
            logits = self._forward([([tok], at, s.block_table) for (tok, at), s in zip(inputs, active)], sample=True)
            tokens = sampler.sample(logits, [_sampling_row(s) for s in active], offsets=[j] * len(active)).tolist()
            for s, tok in zip(active, tokens):
                s.draft[j] = tok
                self.state(s).computed = s.num_tokens + j

    def _forward(self, rows, sample: bool = False) -> torch.Tensor | None:
        model, runner = self.model, self.runner
        input_ids, positions, meta, ends = flatten(rows, self.block_size, model.device.type != "cpu")
        runner.staging.next_step()
        input_ids, positions = runner.to_device(input_ids, positions, meta)
        hidden = model.forward(StepContext(positions, meta, runner.kv.layers, input_ids=input_ids))
        return model.raw_logits(hidden[runner.staging.to_device("logit_rows", torch.tensor(ends))]) if sample else None

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None:
        super().observe(seq, proposed, accepted)
        state = self.state(seq)
        state.computed = min(state.computed, seq.num_computed)  # past the verified tokens it holds rejected ones


def _sampling_row(seq: Sequence) -> CachedRow:
    """The row as the sampler reads it: sampling its next token (output position `seq.num_output`), a proposal
    drawn with the row's own key at the position it proposes for (offsets add the proposal's index)."""
    return CachedRow(seq.seq_id, seq.num_prompt, seq.token_ids, seq.block_table, seq.params, seq.rng_key,
                     seq.stop_token_set, num_computed=seq.num_tokens - 1, num_new=1, num_sampled=1)
