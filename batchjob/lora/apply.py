"""LoRA adapters on a built model: each adapter has a slot; every base matmul an adapter targets is wrapped so that, for
the step's tokens of each slot, `(x A^T) B^T` is added to its output slice (shrink, then expand; the scale folded
into B), beside the base matmul (which may be int8: the adapter stays in the compute dtype). Fused projections take
their parts' deltas in their own output slices (q, k, v of QKV; gate and up). A token's delta comes from its own row
through matmuls that give the same sums for any number of rows (kernels/linear.py Linear): a row's output does not
depend on which adapters, or how many rows, share its step."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from batchjob.kernels import Linear
from batchjob.kernels.quantization import WeightMatmul
from batchjob.lora.adapter import LoraAdapter, LoraError
from batchjob.models.layers import MLP
from batchjob.models.step_context import ModelFeature


@dataclass(frozen=True, slots=True)
class Part:
    """One adapter's share of one base matmul: its A (shrink) and scaled B (expand), into output columns [start, end)."""
    a: Linear
    b: Linear
    start: int
    end: int


@dataclass(slots=True, eq=False)
class AdapterSet:
    """The adapters on a model, slot i = adapters[i]; `segments`: this step's (slot, token indices), set by the
    model's forward from the step's adapter ids and read by every wrapped matmul."""
    adapters: list[LoraAdapter]
    segments: list[tuple[int, torch.Tensor]] | None = None
    slots: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = {a.name: i for i, a in enumerate(self.adapters)}

    def begin(self, adapter_ids: torch.Tensor | None) -> None:
        """The step's segments: for each adapter in it, the indices of its tokens (ascending)."""
        if adapter_ids is None:
            self.segments = None
            return
        present = sorted(set(adapter_ids.tolist()) - {-1})
        self.segments = [(s, (adapter_ids == s).nonzero().squeeze(1)) for s in present]


@dataclass(slots=True, eq=False)
class LoraMatmul:
    """A base matmul with its adapters' deltas added for their tokens."""
    base: WeightMatmul
    parts: dict[int, tuple[Part, ...]]  # slot -> parts
    adapters: AdapterSet

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, idx in self.adapters.segments or ():
            parts = self.parts.get(slot)
            if not parts:
                continue
            xs = x.index_select(0, idx)
            for p in parts:
                y[idx, p.start:p.end] += p.b(p.a(xs))
        return y


def _places(model) -> dict[str, tuple[str, str, int, int, int]]:
    """PEFT module name -> (block, matmul, output start, output end, input size) in a decoder layer."""
    c = model.config
    q, kv, i, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size, c.hidden_size
    return {"q_proj": ("attn", "qkv", 0, q, h), "k_proj": ("attn", "qkv", q, q + kv, h),
            "v_proj": ("attn", "qkv", q + kv, q + 2 * kv, h), "qkv_proj": ("attn", "qkv", 0, q + 2 * kv, h),
            "o_proj": ("attn", "o", 0, h, q), "gate_proj": ("mlp", "gate_up", 0, i, h),
            "up_proj": ("mlp", "gate_up", i, 2 * i, h), "gate_up_proj": ("mlp", "gate_up", 0, 2 * i, h),
            "down_proj": ("mlp", "down", 0, h, i)}


def attach(model, adapters: list[LoraAdapter]) -> AdapterSet:
    """Put `adapters` on `model` (a DecoderLM) as slots 0..n-1; LoraError names an adapter that does not fit it."""
    places, dtype, device = _places(model), model.dtype, model.device
    found = AdapterSet(list(adapters))
    wrapped: dict[tuple[int, str, str], dict[int, list[Part]]] = {}
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
            part = Part(Linear(a.to(device=device, dtype=dtype)), Linear((b * adapter.scale).to(device=device, dtype=dtype)),
                        start, end)
            wrapped.setdefault((layer, block, name), {}).setdefault(slot, []).append(part)
    for (layer, block, name), parts in wrapped.items():
        holder = getattr(model.layers[layer], block)
        setattr(holder, name, LoraMatmul(getattr(holder, name), {s: tuple(p) for s, p in parts.items()}, found))
    model.adapters = found
    model.features = model.features | {ModelFeature.LORA}
    return found
