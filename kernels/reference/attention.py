"""The torch reference of paged attention and the KV store: the oracle of the compiled and Triton
kernels, and the fallback where they cannot be built. It gathers each row's context out of the cache and runs SDPA, with decodes in a few groups of
similar context length, fresh prompts as plain causal groups and continued chunks with an offset mask;
that plan is built once per step and shared by every layer. Padding changes how SDPA blocks its sums,
so its result moves by an ulp with a row's batch-mates; the native kernel's does not.

`per_row=True` (what the engine runs on a CPU when it runs these references: `--kernels torch`, or no compiler for
the native ones) makes every row a group of its own with its exact context: a row's result then depends on its own
tokens only, not on its batch (batch-invariant, docs/design/determinism.md), at the cost of one SDPA call per row
and layer.

`meta.key_ends` (an image's tokens seeing each other both ways: Gemma 3) widens a query's keys past itself; its rows
run in the masked group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from batchjob.kernels.interface import AttentionMetadata
from batchjob.kernels.reference.kv_quant import QuantizedKV


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache, v_cache, slot_mapping: torch.Tensor) -> None:
    # k: [T, Hkv, D] into k_cache [num_blocks, block_size, Hkv, D] (or a QuantizedKV, quantized on the way)
    if isinstance(k_cache, QuantizedKV):
        k_cache.store(k, slot_mapping)
        v_cache.store(v, slot_mapping)
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, window: int | None = None, softcap: float | None = None,
                          per_row: bool = False) -> torch.Tensor:
    """q: [T, H, D] (new tokens, rotated; their K/V already stored). Returns [T, H, D]. `softcap`: attention
    logits become tanh(s / cap) * cap before the softmax (Gemma 2). `per_row`: each row alone (batch-invariant)."""
    sdpa = F.scaled_dot_product_attention if softcap is None else _softcapped(softcap)
    key = ("torch", window, per_row)  # the masks depend on the window
    plan = meta.plans.get(key)
    if plan is None:
        plan = meta.plans[key] = _TorchPlan(meta, k_cache.shape[1], window, q.device, per_row)
    out = torch.empty_like(q)
    for rows, slots, mask in plan.decode_groups:
        k = _gather(k_cache, slots, q.dtype)
        v = _gather(v_cache, slots, q.dtype)
        o = sdpa(q[rows].unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(2)
    for gather, valid, slots, mask in plan.prefill_groups:
        k = _gather(k_cache, slots, q.dtype)
        v = _gather(v_cache, slots, q.dtype)
        qp = q[gather].transpose(1, 2)  # [n, H, Qmax, D]
        o = sdpa(qp, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True)
        out[gather[valid]] = o.transpose(1, 2)[valid]
    return out


def _softcapped(cap: float):
    """SDPA's signature, with the logits soft-capped (SDPA itself cannot): softmax in fp32."""
    def attend(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=True):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = (q.float() @ k.float().transpose(-1, -2)) * scale
        s = torch.tanh(s / cap) * cap
        if is_causal:
            attn_mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf"))
        return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)
    return attend


def _gather(cache, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # [S, L] slots -> [S, Hkv, L, D]; index_select on flat token rows is several times faster than
    # advanced indexing by block on CPU; a quantized cache is dequantized to the compute dtype here
    if isinstance(cache, QuantizedKV):
        return cache.gather(slots, dtype)
    s, length = slots.shape
    hkv, d = cache.shape[2], cache.shape[3]
    kv = cache.view(-1, hkv * d).index_select(0, slots.view(-1))
    return kv.view(s, length, hkv, d).transpose(1, 2)


def length_groups(n: int, max_groups: int = 4, min_rows: int = 16) -> list[tuple[int, int]]:
    """Split n rows sorted by length into up to `max_groups` runs of equal size, each padded only to its
    own longest row. Measured on SmolLM2 W1 (62 rows, contexts 40-280): gather + SDPA per layer 10-15%
    faster with 3-4 groups than one padded batch; more groups cost more in per-call overhead."""
    if not n:
        return []
    groups = max(1, min(max_groups, n // min_rows))
    edges = [round(i * n / groups) for i in range(groups + 1)]
    return list(zip(edges, edges[1:]))


def _singletons(n: int, **_) -> list[tuple[int, int]]:
    """Every row a group of its own (per_row): no padding, no batch-mates."""
    return [(i, i + 1) for i in range(n)]


class _TorchPlan:
    """Gather indices and masks of one step for the torch reference, built from the metadata once."""

    def __init__(self, meta: AttentionMetadata, block_size: int, window: int | None, device: torch.device,
                 per_row: bool = False):
        self.block_size = block_size
        groups = _singletons if per_row else length_groups
        host = meta.host or {}  # on a GPU the runner's host copies: no device read-back (sync) per step
        tables = host["block_tables"] if "block_tables" in host else meta.block_tables.cpu()
        seq_lens = host["seq_lens"] if "seq_lens" in host else meta.seq_lens.tolist()
        qsl = host["query_start_loc"] if "query_start_loc" in host else meta.query_start_loc.tolist()
        nd = meta.num_decodes
        self.decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.prefill_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        # decodes by context length, in groups of similar length
        dec = sorted(range(nd), key=lambda r: seq_lens[r])
        for a, b in groups(len(dec)):
            rows = dec[a:b]
            lens = torch.tensor([seq_lens[r] for r in rows])
            width = int(lens.max())
            keys = torch.arange(width)
            mask = keys[None, :] < lens[:, None]
            if window:
                mask &= keys[None, :] > (lens[:, None] - 1 - window)
            token = torch.tensor([qsl[r] for r in rows])
            self.decode_groups.append((token.to(device), self._slots(tables[rows], width).to(device), mask[:, None, None, :].to(device)))
        # prompt chunks: fresh prompts (nothing cached before the chunk) run as plain causal attention
        # (no mask) in groups of similar length; chunks that continue a row (chunked prefill, prefix-cache
        # hits) need the causal mask offset by what is cached, and go together in one masked group
        pre = [(r, qsl[r], qsl[r + 1] - qsl[r], seq_lens[r] - (qsl[r + 1] - qsl[r])) for r in range(nd, len(seq_lens))]
        # key_ends: tokens that see keys past themselves (an image's bidirectional run) need the masked group too
        ends = host["key_ends"] if "key_ends" in host else (None if meta.key_ends is None else meta.key_ends.cpu())
        self.key_ends = ends
        wide = set() if ends is None else {p[0] for p in pre if bool(
            (ends[p[1]:p[1] + p[2]] > torch.arange(p[3] + 1, p[3] + p[2] + 1)).any())}
        fresh = sorted((p for p in pre if p[3] == 0 and not window and p[0] not in wide), key=lambda p: p[2])
        cont = [p for p in pre if p[3] != 0 or window or p[0] in wide]
        for a, b in groups(len(fresh), min_rows=4):
            self.prefill_groups.append(self._prefill_group(fresh[a:b], tables, None, device))
        for a, b in (groups(len(cont), min_rows=len(cont)) if cont else []):
            self.prefill_groups.append(self._prefill_group(cont[a:b], tables, window, device, offset=True))

    def _slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        """[S, length] cache slot of every context position of each row (past a row's end: masked)."""
        bs = self.block_size
        width = -(-length // bs)
        bt = tables[:, :width].long()
        slots = bt[:, :, None] * bs + torch.arange(bs)
        return slots.view(len(tables), -1)[:, :length].contiguous()

    def _prefill_group(self, rows: list[tuple[int, int, int, int]], tables: torch.Tensor, window: int | None,
                       device: torch.device, offset: bool = False) -> tuple:
        """(gather [S, Qmax] batch index of each query (pad -> 0), valid [S, Qmax], context slots [S, L],
        mask [S, 1, Qmax, L] or None = plain causal: every row starts at position 0 and L == Qmax, so a
        padded query row sees only padding and is dropped)."""
        qmax = max(n for _, _, n, _ in rows)
        q_off = torch.arange(qmax)
        firsts = torch.tensor([f for _, f, _, _ in rows])
        counts = torch.tensor([n for _, _, n, _ in rows])
        valid = q_off[None, :] < counts[:, None]
        gather = torch.where(valid, firsts[:, None] + q_off[None, :], torch.zeros((), dtype=torch.long))
        sub = tables[[r for r, _, _, _ in rows]]
        if not offset:
            return gather.to(device), valid.to(device), self._slots(sub, qmax).to(device), None
        starts = torch.tensor([st for _, _, _, st in rows])
        length = int((starts + counts).max())
        keys = torch.arange(length)
        qpos = starts[:, None] + q_off[None, :]  # [S, Qmax] absolute positions
        kend = qpos + 1  # each query's keys end: causal, or past itself where key_ends says so
        if self.key_ends is not None:
            kend = torch.maximum(kend, torch.where(valid, self.key_ends.long()[gather], 0))
        mask = keys[None, None, :] < kend[:, :, None]
        if window:
            mask &= keys[None, None, :] > (qpos[:, :, None] - window)
        mask &= valid[:, :, None]
        mask[:, :, 0] |= ~valid  # padded query rows attend to one key so no row is all-masked
        return gather.to(device), valid.to(device), self._slots(sub, length).to(device), mask[:, None].to(device)
