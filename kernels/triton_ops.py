"""Triton kernels for the GPU path, one per torch reference, over the same paged interface.

Must equal: kernels/attention.py (store_kv, paged_attention_torch), kernels/norm.py (rms_norm), kernels/
rotary.py (apply_rotary), F.silu(gate) * up; tested by tests/test_triton_kernels.py under the interpreter
(TRITON_INTERPRET=1, fp32 and fp16: the interpreter computes bf16 on raw bits) and on CUDA by
`make gpu-check`. Every kernel loads its inputs, computes in fp32 and casts only at the store.

The KV cache keeps the reference layout, [blocks, block_size, kv_heads, head_dim], so a Triton step and
a torch step read the same cache. Decode attention packs the query heads of one KV head into one tile
(GQA: each K/V block is read once per KV head) and splits long contexts into fixed 512-token pieces
merged by log-sum-exp in split order: a row's result never depends on the batch beside it.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = None

SPLIT = 512  # tokens per decode split; a constant, so results do not depend on batch composition


def available(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else why not."""
    if triton is None:
        return "triton is not installed"
    if device.type == "cuda":
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return f"Triton kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def _online_softmax(s, v, m, s_sum, acc):
        """One key block into each query row's running max m, sum s_sum and output acc; s: masked scores."""
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        s_sum = s_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
        return m_new, s_sum, acc

    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, SLOTS, stride_k, stride_v, WIDTH: tl.constexpr, W_PAD: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t)
        if slot >= 0:
            offs = tl.arange(0, W_PAD)
            m = offs < WIDTH
            k = tl.load(K + t * stride_k + offs, mask=m)
            v = tl.load(V + t * stride_v + offs, mask=m)
            tl.store(KC + slot * WIDTH + offs, k, mask=m)
            tl.store(VC + slot * WIDTH + offs, v, mask=m)

    @triton.jit
    def _decode_split_kernel(Q, K, V, OUT, LSE, BT, SEQ, QSL, scale, stride_q, stride_bt, num_kv_heads, window,
                             max_splits, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                             BLOCK: tl.constexpr, SPLIT_TOKENS: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        seq_len = tl.load(SEQ + row)
        tok = tl.load(QSL + row)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        gm = g < G
        dm = d < D
        q = tl.load(Q + tok * stride_q + (h * G + g)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :],
                    other=0.0)
        start = sp * SPLIT_TOKENS
        end = tl.minimum(start + SPLIT_TOKENS, seq_len)
        lo = 0
        if window > 0:
            lo = tl.maximum(seq_len - window, 0)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        s_sum = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        width = num_kv_heads * D
        for kb in range(start, end, BLOCK):
            blk = tl.load(BT + row * stride_bt + kb // BLOCK).to(tl.int64)
            j = tl.arange(0, BLOCK)
            kpos = kb + j
            km = (kpos < end) & (kpos >= lo)
            ptr = (blk * BLOCK + j)[:, None] * width + h * D + d[None, :]
            k = tl.load(K + ptr, mask=km[:, None] & dm[None, :], other=0.0)
            v = tl.load(V + ptr, mask=km[:, None] & dm[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # operands in the cache dtype, fp32 sums
            m, s_sum, acc = _online_softmax(tl.where(km[None, :], s, float("-inf")), v, m, s_sum, acc)
        has = s_sum > 0
        out = acc / tl.where(has, s_sum, 1.0)[:, None]
        lse = tl.where(has, m + tl.log(tl.where(has, s_sum, 1.0)), float("-inf"))
        base = (row * num_kv_heads + h) * max_splits + sp
        tl.store(OUT + (base * G_PAD + g)[:, None] * D_PAD + d[None, :], out)
        tl.store(LSE + base * G_PAD + g, lse)

    @triton.jit
    def _decode_merge_kernel(OUT_PART, LSE, O, SEQ, QSL, stride_o, num_kv_heads, max_splits, G: tl.constexpr,
                             G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLIT_TOKENS: tl.constexpr):
        row = tl.program_id(0)
        h = tl.program_id(1)
        seq_len = tl.load(SEQ + row)
        tok = tl.load(QSL + row)
        n_splits = tl.cdiv(seq_len, SPLIT_TOKENS)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for sp in range(0, n_splits):  # in split order: the merge is the same whatever the batch
            base = (row * num_kv_heads + h) * max_splits + sp
            lse = tl.load(LSE + base * G_PAD + g)
            part = tl.load(OUT_PART + (base * G_PAD + g)[:, None] * D_PAD + d[None, :])
            m_new = tl.maximum(m, lse)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - m_safe)
            w = tl.exp(lse - m_safe)
            total = total * a + w
            acc = acc * a[:, None] + w[:, None] * part
            m = m_new
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        gm = g < G
        dm = d < D
        tl.store(O + tok * stride_o + (h * G + g)[:, None] * D + d[None, :], out.to(O.dtype.element_ty),
                 mask=gm[:, None] & dm[None, :])

    @triton.jit
    def _prefill_kernel(Q, K, V, O, BT, SEQ, QSL, TILE_ROW, TILE_START, scale, stride_q, stride_o, stride_bt,
                        num_heads, num_kv_heads, window, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        h = head // G
        row = tl.load(TILE_ROW + tile)
        t0 = tl.load(TILE_START + tile)
        qs = tl.load(QSL + row)
        qe = tl.load(QSL + row + 1)
        seq_len = tl.load(SEQ + row)
        first_pos = seq_len - (qe - qs)
        i = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D_PAD)
        tok = t0 + i
        qm = tok < qe
        dm = d < D
        qpos = first_pos + (tok - qs)
        q = tl.load(Q + tok[:, None] * stride_q + head * D + d[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
        last = tl.minimum(t0 + BLOCK_M, qe) - 1
        hi = first_pos + (last - qs) + 1  # keys [lo, hi) cover every query of the tile
        lo = 0
        if window > 0:
            lo = tl.maximum(first_pos + (t0 - qs) - window + 1, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        width = num_kv_heads * D
        for kb in range((lo // BLOCK) * BLOCK, hi, BLOCK):
            blk = tl.load(BT + row * stride_bt + kb // BLOCK).to(tl.int64)
            j = tl.arange(0, BLOCK)
            kpos = kb + j
            ptr = (blk * BLOCK + j)[:, None] * width + h * D + d[None, :]
            kv_m = (kpos < hi)[:, None] & dm[None, :]
            k = tl.load(K + ptr, mask=kv_m, other=0.0)
            v = tl.load(V + ptr, mask=kv_m, other=0.0)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < hi)
            if window > 0:
                visible = visible & (kpos[None, :] > qpos[:, None] - window)
            m, s_sum, acc = _online_softmax(tl.where(visible, s, float("-inf")), v, m, s_sum, acc)
        out = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]
        tl.store(O + tok[:, None] * stride_o + head * D + d[None, :], out.to(O.dtype.element_ty),
                 mask=qm[:, None] & dm[None, :])

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, OUT, stride_x, n, eps, HAS_X: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        m = offs < n
        h = tl.load(R + row * n + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_X:
            h = h + tl.load(X + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
            h = h.to(R.dtype.element_ty)  # the residual is stored, and normed, in its own dtype
            tl.store(R + row * n + offs, h, mask=m)
            h = h.to(tl.float32)
        var = tl.sum(h * h, 0) / n
        normed = (h * (1.0 / tl.sqrt(var + eps))).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + row * n + offs, (w * normed).to(OUT.dtype.element_ty), mask=m)

    @triton.jit
    def _rotary_kernel(X, COS, SIN, POS, stride_t, heads, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
        t = tl.program_id(0)
        pos = tl.load(POS + t)
        hh = tl.arange(0, H_PAD)
        i = tl.arange(0, HALF_PAD)
        m = (hh < heads)[:, None] & (i < HALF)[None, :]
        base = X + t * stride_t + hh[:, None] * (2 * HALF) + i[None, :]
        x1 = tl.load(base, mask=m, other=0.0)
        x2 = tl.load(base + HALF, mask=m, other=0.0)
        dt = x1.dtype
        c1 = tl.load(COS + pos * 2 * HALF + i, mask=i < HALF, other=0.0)[None, :]
        s1 = tl.load(SIN + pos * 2 * HALF + i, mask=i < HALF, other=0.0)[None, :]
        c2 = tl.load(COS + pos * 2 * HALF + HALF + i, mask=i < HALF, other=0.0)[None, :]
        s2 = tl.load(SIN + pos * 2 * HALF + HALF + i, mask=i < HALF, other=0.0)[None, :]
        f = tl.float32
        # torch's order and roundings: q * cos + rotate_half(q) * sin, each op rounded to the dtype
        a = (x1.to(f) * c1.to(f)).to(dt).to(f)
        b = ((-x2.to(f)) * s1.to(f)).to(dt).to(f)
        y1 = (a + b).to(dt)
        a2 = (x2.to(f) * c2.to(f)).to(dt).to(f)
        b2 = (x1.to(f) * s2.to(f)).to(dt).to(f)
        y2 = (a2 + b2).to(dt)
        tl.store(base, y1, mask=m)
        tl.store(base + HALF, y2, mask=m)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, n, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(GU + t * 2 * n + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(GU + t * 2 * n + n + offs, mask=m, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + t * n + offs, (silu * u).to(OUT.dtype.element_ty), mask=m)


class TritonKernels:
    """The Triton kernel set (kernels/dispatch.py): the reference cache layout, Triton everywhere else."""

    name = "triton"

    def __init__(self, head_dim: int, gqa: int, dtype: torch.dtype, block_size: int):
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size}: the Triton kernels need a power of two >= 16")
        self.head_dim, self.gqa, self.dtype, self.block_size = head_dim, gqa, dtype, block_size

    @staticmethod
    def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        t, hkv, d = k.shape
        if k.stride(2) != 1 or k.stride(1) != d:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != d:
            v = v.contiguous()
        if t:
            _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), WIDTH=hkv * d,
                                   W_PAD=_pow2(hkv * d))

    def attention(self, q, k_cache, v_cache, meta, scale, window=None):
        t, h, d = q.shape
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
        plan = meta.plans.get("triton")
        if plan is None:
            plan = meta.plans["triton"] = _Plan(meta, self.block_size, q.device)
        hkv = k_cache.shape[2]
        g, bt = h // hkv, meta.block_tables
        nd = meta.num_decodes
        if nd:
            gp, dp = max(16, _pow2(g)), _pow2(d)
            part = torch.empty((nd, hkv, plan.max_splits, gp, dp), dtype=torch.float32, device=q.device)
            lse = torch.empty((nd, hkv, plan.max_splits, gp), dtype=torch.float32, device=q.device)
            _decode_split_kernel[(nd, hkv, plan.max_splits)](
                q, k_cache, v_cache, part, lse, bt, meta.seq_lens, meta.query_start_loc, scale, q.stride(0), bt.stride(0),
                hkv, window or 0, plan.max_splits, G=g, G_PAD=gp, D=d, D_PAD=dp, BLOCK=self.block_size, SPLIT_TOKENS=SPLIT)
            _decode_merge_kernel[(nd, hkv)](part, lse, out, meta.seq_lens, meta.query_start_loc, out.stride(0), hkv,
                                            plan.max_splits, G=g, G_PAD=gp, D=d, D_PAD=dp, SPLIT_TOKENS=SPLIT)
        if plan.num_tiles:
            _prefill_kernel[(plan.num_tiles, h)](
                q, k_cache, v_cache, out, bt, meta.seq_lens, meta.query_start_loc, plan.tile_row, plan.tile_start, scale,
                q.stride(0), out.stride(0), bt.stride(0), h, hkv, window or 0, G=g, D=d, D_PAD=_pow2(d),
                BLOCK_M=plan.block_m, BLOCK=self.block_size)
        return out

    def rms_norm(self, x, weight, eps):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.shape[-1]
        _add_rms_norm_kernel[(x.numel() // n,)](x, x, weight, out, 0, n, eps, HAS_X=False, BLOCK=_pow2(n))
        return out

    def add_rms_norm(self, x, residual, weight, eps):
        if x.stride(-1) != 1:
            x = x.contiguous()
        out = torch.empty_like(residual)
        n = residual.shape[-1]
        _add_rms_norm_kernel[(residual.shape[0],)](x, residual, weight, out, x.stride(0), n, eps, HAS_X=True, BLOCK=_pow2(n))
        return out

    @staticmethod
    def prepare_rotary(rope, positions):
        return rope.cos, rope.sin, positions

    def rotary(self, q, k, prepared):
        cos, sin, positions = prepared
        for x in (q, k):
            t, heads, d = x.shape
            if x.stride(2) != 1 or x.stride(1) != d:
                raise RuntimeError("Triton rotary needs [T, H, D] with dense heads")
            if t:
                _rotary_kernel[(t,)](x, cos, sin, positions, x.stride(0), heads, HALF=d // 2, H_PAD=_pow2(heads),
                                     HALF_PAD=_pow2(d // 2))
        return q, k

    def silu_mul(self, gate_up):
        gate_up = gate_up.contiguous()
        n = gate_up.shape[-1] // 2
        rows = gate_up.numel() // (2 * n)
        out = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, _pow2(n))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
        return out


class _Plan:
    """Launch shapes of one step, from host copies of the metadata (built once, shared by every layer)."""

    def __init__(self, meta, block_size: int, device: torch.device):
        qsl = meta.query_start_loc.tolist() if meta.host is None else meta.host["query_start_loc"]
        seq_lens = meta.seq_lens.tolist() if meta.host is None else meta.host["seq_lens"]
        nd = meta.num_decodes
        self.max_splits = max([-(-n // SPLIT) for n in seq_lens[:nd]], default=1)
        self.block_m = 16
        rows, starts = [], []
        for r in range(nd, len(seq_lens)):
            for t in range(qsl[r], qsl[r + 1], self.block_m):
                rows.append(r)
                starts.append(t)
        self.num_tiles = len(rows)
        self.tile_row = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
        self.tile_start = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
