"""Model ops over one paged interface (interface.py). Attention, KV store, norms, rotary and SiLU each have a
torch reference (reference/: the test oracle and the fallback), a compiled CPU kernel (native/csrc/, built at
first use) and a Triton kernel (triton/); weight matmuls are linear.py's. `dispatch.select_kernels` chooses."""
from batchjob.kernels.interface import AttentionMetadata, KernelSet
from batchjob.kernels.reference.attention import paged_attention_torch, store_kv
from batchjob.kernels.dispatch import CHOICES, KernelError, select_kernels
from batchjob.kernels.linear import Linear
from batchjob.kernels.reference.norm import rms_norm
from batchjob.kernels.reference.rotary import RotaryEmbedding, apply_rotary

__all__ = ["AttentionMetadata", "KernelSet", "paged_attention_torch", "store_kv", "CHOICES", "KernelError", "select_kernels",
           "Linear", "rms_norm", "RotaryEmbedding", "apply_rotary"]
