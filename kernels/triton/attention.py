"""Triton paged attention: the KV store by slot mapping, decode (GQA-packed tiles, fixed 512-token splits
merged by log-sum-exp in split order) and prefill/extend (query tiles attending causally to their own
tokens and the row's cached prefix through the block table, or past themselves where `meta.key_ends` says:
an image's bidirectional run), with the optional sliding window and logit soft-cap. Must equal kernels/reference/attention.py (store_kv, paged_attention_torch with its window and softcap)."""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency, but the CPU paths do not need it
    triton = None

from batchjob.kernels.reference.kv_quant import QuantizedKV, group4
from batchjob.kernels.triton.kv_quant import load_kv, store_kv_quantized

SPLIT = 512  # tokens per decode split; a constant, so results do not depend on batch composition


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if triton is not None:

    @triton.jit
    def tanh(x):
        """tanh in fp32 from exp alone (libdevice's does not run under the interpreter): a Taylor series where
        1 - e^-2|x| would cancel, (1 - e) / (1 + e) elsewhere; a few fp32 ulps from torch.tanh, NaN stays NaN."""
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        x2 = x * x
        small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        big = (1.0 - e) / (1.0 + e)
        return tl.where(a < 0.25, small, tl.where(x < 0, -big, big))  # series: next term below 1e-8 relative

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
    def _decode_split_kernel(Q, K, V, KS, VS, OUT, LSE, BT, SEQ, QSL, scale, softcap, stride_q, stride_bt, num_kv_heads,
                             window, max_splits, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                             D_PAD: tl.constexpr, BLOCK: tl.constexpr, SPLIT_TOKENS: tl.constexpr, QUANT: tl.constexpr,
                             GROUP: tl.constexpr, SOFTCAP: tl.constexpr):
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
        for kb in range(start, end, BLOCK):
            blk = tl.load(BT + row * stride_bt + kb // BLOCK).to(tl.int64)
            j = tl.arange(0, BLOCK)
            kpos = kb + j
            km = (kpos < end) & (kpos >= lo)
            slot = blk * BLOCK + j
            k = load_kv(K, KS, slot, h, d, km[:, None] & dm[None, :], num_kv_heads, D, QUANT, GROUP, Q.dtype.element_ty)
            v = load_kv(V, VS, slot, h, d, km[:, None] & dm[None, :], num_kv_heads, D, QUANT, GROUP, Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale  # operands in the compute dtype, fp32 sums
            if SOFTCAP:
                s = tanh(s / softcap) * softcap
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
    def _prefill_kernel(Q, K, V, KS, VS, O, BT, SEQ, QSL, TILE_ROW, TILE_START, scale, softcap, stride_q, stride_o,
                        stride_bt, num_heads, num_kv_heads, window, KEND, G: tl.constexpr, D: tl.constexpr,
                        D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                        GROUP: tl.constexpr, SOFTCAP: tl.constexpr, HAS_KEND: tl.constexpr):
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
        kend = qpos + 1  # each query's keys end: causal, or past itself where KEND says so (an image's run)
        if HAS_KEND:
            kend = tl.maximum(kend, tl.load(KEND + tok, mask=qm, other=0))
            hi = tl.maximum(hi, tl.max(tl.where(qm, kend, 0), 0))
        lo = 0
        if window > 0:
            lo = tl.maximum(first_pos + (t0 - qs) - window + 1, 0)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for kb in range((lo // BLOCK) * BLOCK, hi, BLOCK):
            blk = tl.load(BT + row * stride_bt + kb // BLOCK).to(tl.int64)
            j = tl.arange(0, BLOCK)
            kpos = kb + j
            slot = blk * BLOCK + j
            kv_m = (kpos < hi)[:, None] & dm[None, :]
            k = load_kv(K, KS, slot, h, d, kv_m, num_kv_heads, D, QUANT, GROUP, Q.dtype.element_ty)
            v = load_kv(V, VS, slot, h, d, kv_m, num_kv_heads, D, QUANT, GROUP, Q.dtype.element_ty)
            s = tl.dot(q, tl.trans(k)).to(tl.float32) * scale
            if SOFTCAP:
                s = tanh(s / softcap) * softcap
            visible = (kpos[None, :] < kend[:, None]) & (kpos[None, :] < hi)
            if window > 0:
                visible = visible & (kpos[None, :] > qpos[:, None] - window)
            m, s_sum, acc = _online_softmax(tl.where(visible, s, float("-inf")), v, m, s_sum, acc)
        out = acc / tl.where(s_sum > 0, s_sum, 1.0)[:, None]
        tl.store(O + tok[:, None] * stride_o + head * D + d[None, :], out.to(O.dtype.element_ty),
                 mask=qm[:, None] & dm[None, :])


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    if isinstance(k_cache, QuantizedKV):
        return store_kv_quantized(k, v, k_cache, v_cache, slot_mapping)
    t, hkv, d = k.shape
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    if t:
        _store_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0), WIDTH=hkv * d,
                               W_PAD=pow2(hkv * d))


def attention(q, k_cache, v_cache, meta, scale, block_size: int, window=None, softcap=None):
    """`softcap`: scores become tanh(s / cap) * cap before the masks and softmax (None: the kernels without it)."""
    t, h, d = q.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    plan = meta.plans.get("triton")
    if plan is None:
        plan = meta.plans["triton"] = _Plan(meta, block_size, q.device)
    hkv = k_cache.shape[2]
    g, bt = h // hkv, meta.block_tables
    nd = meta.num_decodes
    quant = k_cache.bits if isinstance(k_cache, QuantizedKV) else 0
    group = group4(d) if quant == 4 else 1
    kc, vc = (k_cache.data, v_cache.data) if quant else (k_cache, v_cache)
    ks, vs = (k_cache.scale, v_cache.scale) if quant else (k_cache, v_cache)  # unread when not quantized
    cap = float(softcap) if softcap is not None else 1.0  # unread without SOFTCAP
    if nd:
        gp, dp = max(16, pow2(g)), pow2(d)
        part = torch.empty((nd, hkv, plan.max_splits, gp, dp), dtype=torch.float32, device=q.device)
        lse = torch.empty((nd, hkv, plan.max_splits, gp), dtype=torch.float32, device=q.device)
        _decode_split_kernel[(nd, hkv, plan.max_splits)](
            q, kc, vc, ks, vs, part, lse, bt, meta.seq_lens, meta.query_start_loc, scale, cap, q.stride(0),
            bt.stride(0), hkv, window or 0, plan.max_splits, G=g, G_PAD=gp, D=d, D_PAD=dp, BLOCK=block_size,
            SPLIT_TOKENS=SPLIT, QUANT=quant, GROUP=group, SOFTCAP=softcap is not None)
        _decode_merge_kernel[(nd, hkv)](part, lse, out, meta.seq_lens, meta.query_start_loc, out.stride(0), hkv,
                                        plan.max_splits, G=g, G_PAD=gp, D=d, D_PAD=dp, SPLIT_TOKENS=SPLIT)
    if plan.num_tiles:
        _prefill_kernel[(plan.num_tiles, h)](
            q, kc, vc, ks, vs, out, bt, meta.seq_lens, meta.query_start_loc, plan.tile_row, plan.tile_start, scale,
            cap, q.stride(0), out.stride(0), bt.stride(0), h, hkv, window or 0,
            meta.key_ends if meta.key_ends is not None else meta.query_start_loc, G=g, D=d, D_PAD=pow2(d),
            BLOCK_M=plan.block_m, BLOCK=block_size, QUANT=quant, GROUP=group, SOFTCAP=softcap is not None,
            HAS_KEND=meta.key_ends is not None)
    return out


def decode_plan(max_context: int) -> _Plan:
    """The plan of any decode-only step whose rows hold at most `max_context` tokens, from that bound alone
    (a CUDA graph replays it whatever the lengths): splits past a row's context do no work and the merge
    reads only the row's own, so the result is that of the step's own plan."""
    plan = _Plan.__new__(_Plan)
    plan.max_splits = max(1, -(-max_context // SPLIT))
    plan.block_m, plan.num_tiles, plan.tile_row, plan.tile_start = 16, 0, None, None
    return plan


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
