"""A model split over tensor-parallel ranks (Megatron-LM's layout, as vLLM lays it): each rank holds its share of the
attention heads (q heads split; KV heads split, or replicated where there are fewer than ranks), of the MLP's
columns (gate/up) and rows (down), and of the vocabulary (embeddings and LM head). Every rank runs the same layers
on its slices; the partial outputs of the attention and MLP blocks are summed across ranks (one all-reduce each),
the embeddings' lookups too (each token's row lives on one rank), and the LM head's vocabulary slices are gathered.

`TensorShard` says which slice of each checkpoint weight a rank holds (read so by the loader: no rank reads the
whole model) and the per-rank sizes (`shard_config`); `RankGroup` is the collectives, on torch.distributed (gloo
on a CPU, NCCL on CUDA). The all-reduce is an all-gather summed in rank order: every rank gets the same bits, and a
row's result does not depend on which rows share the step (a ring all-reduce sums in an order that depends on the
tensor's size, so on the batch)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchjob.models.config import ModelConfig, UnsupportedModelError

# the variants whose layers split so (models/families/): q/k/v and gate/up as separate weights or fused (Phi-3), per-head
# q/k norms (or none), no mixture of experts, no image encoder. OLMo 2 norms q and k over the whole projection (a
# norm over every rank's heads: another collective per layer), not split here.
SPLITTABLE = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")


@dataclass(frozen=True, slots=True)
class TensorShard:
    """Rank `rank` of `world`, for a model of `config` (the whole model's)."""
    rank: int
    world: int
    config: ModelConfig

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world: int, source: str = "model") -> TensorShard:
        """Raises UnsupportedModelError for a model that does not split `world` ways."""
        c = config
        if c.architecture not in SPLITTABLE:
            raise UnsupportedModelError(
                f"{source}: tensor parallel is not implemented for architecture {c.architecture!r}; it splits "
                f"{', '.join(SPLITTABLE)} (use --data-parallel for the others)")
        uneven = [f"{what} {n}" for what, n in (("attention heads", c.num_heads), ("MLP width", c.intermediate_size))
                  if n % world]
        if c.num_kv_heads % world and world % c.num_kv_heads:
            uneven.append(f"KV heads {c.num_kv_heads}")
        if uneven:
            raise UnsupportedModelError(f"{source}: --tensor-parallel {world} does not divide its {', '.join(uneven)}; "
                                        "choose a count that divides them")
        return cls(rank, world, config)

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.world

    @property
    def kv_heads(self) -> int:
        """KV heads per rank: a share, or one replicated head where the ranks outnumber them."""
        return max(1, self.config.num_kv_heads // self.world)

    @property
    def kv_head_start(self) -> int:
        c = self.config
        if c.num_kv_heads >= self.world:
            return self.rank * self.kv_heads
        return self.rank // (self.world // c.num_kv_heads)  # the head this rank's q heads read

    @property
    def vocab_rows(self) -> int:
        """The rows of the vocabulary each rank holds (the last rank's padded with zero rows)."""
        return -(-self.config.vocab_size // self.world)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def shard_config(self) -> ModelConfig:
        """This rank's sizes: its heads, KV heads, MLP width and vocabulary rows (what its weights' shapes are)."""
        c = self.config
        return dataclasses.replace(c, num_heads=self.heads, num_kv_heads=self.kv_heads,
                                   intermediate_size=c.intermediate_size // self.world, vocab_size=self.vocab_rows)

    def pieces(self, name: str, shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int]]] | None:
        """Which part of the checkpoint weight `name` (of `shape`) this rank holds: (the dim cut, its (start, stop)
        ranges, concatenated in order), or None for the whole (norms, per-head q/k norms)."""
        c, d = self.config, self.config.head_dim
        q = (self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        kv = (self.kv_head_start * d, (self.kv_head_start + self.kv_heads) * d)
        inter = c.intermediate_size // self.world
        mlp = (self.rank * inter, (self.rank + 1) * inter)
        leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else name
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, [(self.vocab_start, min(self.vocab_start + self.vocab_rows, shape[0]))]
        if leaf == "q_proj":
            return 0, [q]
        if leaf in ("k_proj", "v_proj"):
            return 0, [kv]
        if leaf == "qkv_proj":  # Phi-3: [q; k; v] in one tensor
            qs, kvs = c.num_heads * d, c.num_kv_heads * d
            return 0, [q, (qs + kv[0], qs + kv[1]), (qs + kvs + kv[0], qs + kvs + kv[1])]
        if leaf == "o_proj":
            return 1, [q]
        if leaf in ("gate_proj", "up_proj"):
            return 0, [mlp]
        if leaf == "gate_up_proj":  # Phi-3: [gate; up]
            return 0, [mlp, (c.intermediate_size + mlp[0], c.intermediate_size + mlp[1])]
        if leaf == "down_proj":
            return 1, [mlp]
        return None

    def take(self, name: str, shape: tuple[int, ...], read) -> torch.Tensor:
        """This rank's part of a weight; `read(index)` reads a slice of it (a safetensors slice's []), so only the
        part is read. Vocabulary slices are padded to `vocab_rows` with zero rows."""
        cut = self.pieces(name, shape)
        if cut is None:
            return read(slice(None))
        dim, ranges = cut
        parts = [read(slice(a, b)) if dim == 0 else read((slice(None), slice(a, b))) for a, b in ranges]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and t.shape[0] < self.vocab_rows:
            t = torch.cat([t, t.new_zeros(self.vocab_rows - t.shape[0], *t.shape[1:])])
        return t


class RankGroup:
    """The collectives a split model's forward makes, over the default torch.distributed group (the job's ranks)."""

    def __init__(self, shard: TensorShard, lost: Callable[[float], str | None] | None = None):
        """`lost(wait_s)`: which rank ended, in words (rank 0's view of the processes: engine/tensor_parallel.py), for
        the error of a step whose collective failed; None where it cannot tell."""
        self.shard = shard
        self.lost = lost or (lambda wait_s: None)

    @property
    def world(self) -> int:
        return self.shard.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x`, added in rank order (the same bits on each rank, whatever the batch)."""
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        out = parts[0]
        for p in parts[1:]:
            out += p
        return out

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[T, vocab slice] on each rank -> [T, vocab] on each (the padding rows dropped)."""
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :self.shard.config.vocab_size]

    def embed_mask(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row of each id in this rank's slice (0 where it lies elsewhere), whether it lies here [T, 1])."""
        local = ids - self.shard.vocab_start
        here = (local >= 0) & (local < self.shard.vocab_rows)
        return torch.where(here, local, torch.zeros_like(local)), here.unsqueeze(-1)
