"""LoRA adapters on a model: each adapter has a slot; the model is built with them (build_model's `adapters`) and
every projection an adapter targets holds every slot's A and B, so that each token gets `(x A^T) B^T` of its own
adapter added beside the base matmul (which may be int8: the adapter stays in the compute dtype), the scale folded
into B. Fused projections take their parts' deltas in their own output columns
(q, k, v of QKV; gate and up). The shrink and the expand are one matmul each over every adapter's stacked A and B (a
token's other slots zeroed between them, as punica's and vLLM's batched LoRA kernels do per segment), through
matmuls that give the same sums for any number of rows (kernels/linear.py Linear): a row's output does not depend on
which adapters, or how many rows, share its step; a step costs two small matmuls per targeted projection whatever
its adapters (measured: 8 adapters as one matmul each per adapter were 1.66x the base job; docs/benchmarks.md)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchjob.kernels import LoraWeights
from batchjob.lora.adapter import LoraAdapter, LoraError
from batchjob.models.adapters import LoraStep
from batchjob.models.layers import MLP


@dataclass(frozen=True, slots=True, eq=False)
class AdapterSet:
    """The adapters a model is built with, slot i = adapters[i] (models/adapters.py ModelAdapters): it puts their
    weights on the model's projections while the model is built, and makes each step's LoraStep from the step's
    slots. It keeps nothing of a step."""
    adapters: tuple[LoraAdapter, ...]

    @classmethod
    def of(cls, adapters: list[LoraAdapter]) -> AdapterSet:
        return cls(tuple(adapters))

    @property
    def slots(self) -> dict[str, int]:
        return slots_of([a.name for a in self.adapters])

    @property
    def digests(self) -> list[str]:
        return [a.digest for a in self.adapters]

    def step(self, adapter_ids: torch.Tensor, dtype: torch.dtype) -> LoraStep:
        ids = adapter_ids.long()
        keep = torch.nn.functional.one_hot(ids.clamp(min=0), len(self.adapters)) * (ids >= 0)[:, None]
        return LoraStep(adapter_ids, keep.to(dtype))

    def put_on(self, model) -> None:
        _put_on(model, list(self.adapters))


def slots_of(names: list[str]) -> dict[str, int]:
    """Each adapter's slot: slot i is the i-th adapter given (what the model is built with, and what the job asks rows for)."""
    return {name: slot for slot, name in enumerate(names)}


def _places(model) -> dict[str, tuple[str, str, int, int, int]]:
    """PEFT module name -> (block, matmul, output start, output end, input size) in a decoder layer."""
    c = model.config
    q, kv, i, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, c.hidden_size
    return {"q_proj": ("attn", "qkv", 0, q, h), "k_proj": ("attn", "qkv", q, q + kv, h),
            "v_proj": ("attn", "qkv", q + kv, q + 2 * kv, h), "qkv_proj": ("attn", "qkv", 0, q + 2 * kv, h),
            "o_proj": ("attn", "o", 0, h, q), "gate_proj": ("mlp", "gate_up", 0, i, h),
            "up_proj": ("mlp", "gate_up", i, 2 * i, h), "gate_up_proj": ("mlp", "gate_up", 0, 2 * i, h),
            "down_proj": ("mlp", "down", 0, h, i)}


def _put_on(model, adapters: list[LoraAdapter]) -> None:
    """Every slot's A and B on the projections of `model` (a DecoderLM being built) they target, stacked per
    projection (its `*_lora` field); LoraError names an adapter that does not fit it."""
    places, dtype, device = _places(model), model.dtype, model.device
    pieces: dict[tuple[int, str, str], dict[int, list]] = {}  # (layer, block, matmul) -> slot -> [(A, B, start, end)]
    for slot, adapter in enumerate(adapters):
        where = f"lora {adapter.name!r} ({adapter.path})"
        for (layer, module), (a, b) in sorted(adapter.weights.items()):
            if layer >= len(model.layers):
                raise LoraError(f"{where}: layer {layer}: the base model has {len(model.layers)} layers")
            block, name, start, end, width = places[module]
            if block == "mlp" and not isinstance(model.layers[layer].mlp, MLP):
                raise LoraError(f"{where}: layer {layer} {module}: LoRA on mixture-of-experts layers is not supported")
            if a.shape[1] != width or b.shape[0] != end - start:
                raise LoraError(f"{where}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit "
                                f"the base model's {width} -> {end - start} projection (another base model?)")
            pieces.setdefault((layer, block, name), {}).setdefault(slot, []).append((a, b * adapter.scale, start, end))

    shapes: dict[tuple[str, str], tuple[int, int]] = {}  # a base matmul's (outputs, inputs): its parts' widest end
    for block, name, _, end, width in places.values():
        shapes[block, name] = (max(end, shapes.get((block, name), (0, 0))[0]), width)
    for (layer, block, name), by_slot in pieces.items():
        rank = max(sum(a.shape[0] for a, _, _, _ in parts) for parts in by_slot.values())
        outputs, inputs = shapes[block, name]
        a_all = torch.zeros(len(adapters), rank, inputs)
        b_all = torch.zeros(len(adapters), outputs, rank)
        for slot, parts in by_slot.items():
            r = 0
            for a, b, start, end in parts:
                a_all[slot, r:r + a.shape[0]] = a
                b_all[slot, start:end, r:r + a.shape[0]] = b
                r += a.shape[0]
        holder = getattr(model.layers[layer], block)
        weights = LoraWeights.of(a_all.to(device=device, dtype=dtype), b_all.to(device=device, dtype=dtype))
        setattr(holder, f"{name}_lora", weights)  # a declared field of the block (models/layers.py)
