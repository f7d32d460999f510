"""Model ops. Each op has a torch reference (the CPU path and the test oracle); Triton kernels are
chosen at the one dispatch point in each module when tensors are on CUDA or the interpreter is on."""
from .attention import AttentionMetadata, paged_attention, store_kv
from .linear import Linear
from .norm import rms_norm
from .rotary import RotaryEmbedding, apply_rotary

__all__ = ["AttentionMetadata", "paged_attention", "store_kv", "Linear", "rms_norm", "RotaryEmbedding", "apply_rotary"]
