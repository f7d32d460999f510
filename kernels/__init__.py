"""Model ops. Each op has a torch reference (the test oracle and the fallback) beside its compiled CPU
kernel (kernels/csrc/, built at first use); `dispatch.select_kernels` is the one place that chooses."""
from .attention import AttentionMetadata, paged_attention_torch, store_kv
from .dispatch import CHOICES, KernelError, select_kernels
from .linear import Linear
from .norm import rms_norm
from .rotary import RotaryEmbedding, apply_rotary

__all__ = ["AttentionMetadata", "paged_attention_torch", "store_kv", "CHOICES", "KernelError", "select_kernels",
           "Linear", "rms_norm", "RotaryEmbedding", "apply_rotary"]
