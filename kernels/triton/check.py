"""The start-up check behind `--kernels auto` on CUDA: the Triton kernels, compiled for the model's shapes,
run one small mixed step (decodes over one and several 512-token splits, a prompt chunk over a cached
prefix; soft-capped when the model caps its attention logits) and every element-wise op the set has, against
the torch references on the same device. Auto uses them only when every result agrees; else it logs why and runs
the references. It costs the kernels' compilation, which the first step would pay anyway, and a few milliseconds.
tests/kernels/triton_cases.py is the full suite."""
from __future__ import annotations

import torch

from batchjob.kernels.interface import AttentionMetadata
from batchjob.kernels.reference import elementwise
from batchjob.kernels.reference.attention import paged_attention_torch, store_kv
from batchjob.kernels.reference.norm import rms_norm
from batchjob.kernels.reference.rotary import RotaryEmbedding, apply_rotary

TOLERANCE = {torch.float32: 5e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # fp32 tl.dot is tf32 on a GPU


def check(kern, device: torch.device, num_kv_heads: int = 2, softcap: float | None = None) -> str | None:
    """None when the Triton kernel set `kern` agrees with the references on `device`, else what differs.
    `softcap`: the model's attention logit soft-cap, if any: the soft-capped attention is checked then (the path
    the model runs), with a cap of 2 that bends these scores (~N(0, 1)); the cap is a run-time argument, any
    value runs the same compiled kernel."""
    dtype, d, gqa, bs = kern.dtype, kern.head_dim, kern.gqa, kern.block_size
    tol = TOLERANCE.get(dtype, 5e-2)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
    spec = [(37, 1), (600, 1), (20, 9)]  # (cached, new) tokens of each row: two decodes, then a chunk
    need = [-(-(c + n) // bs) for c, n in spec]
    ids = torch.randperm(sum(need), generator=g).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(spec))]
    bt = torch.zeros(len(spec), max(need), dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    ctx = [t[p // bs] * bs + p % bs for (c, n), t in zip(spec, tables) for p in range(c + n)]
    new = [t[p // bs] * bs + p % bs for (c, n), t in zip(spec, tables) for p in range(c, c + n)]
    qsl, lens = [0], [c + n for c, n in spec]
    for _, n in spec:
        qsl.append(qsl[-1] + n)
    shape = (sum(need), bs, num_kv_heads, d)
    k, v = rnd(len(ctx), num_kv_heads, d), rnd(len(ctx), num_kv_heads, d)
    caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(4)]
    slots = torch.tensor(ctx, device=device)
    kern.store_kv(k, v, caches[0], caches[1], slots)
    store_kv(k, v, caches[2], caches[3], slots)
    if not (torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])):
        return "KV store differs from the reference"
    q = rnd(qsl[-1], num_kv_heads * gqa, d)
    dev = lambda x, t: torch.tensor(x, dtype=t, device=device)  # noqa: E731
    meta = lambda: AttentionMetadata(bt.to(device), dev(lens, torch.int32), dev(qsl, torch.int32),  # noqa: E731
                                     dev(new, torch.long), 2, host={"query_start_loc": qsl, "seq_lens": lens,
                                                                    "block_tables": bt})
    cap = None if softcap is None else 2.0
    got = kern.attention(q, caches[0], caches[1], meta(), d ** -0.5, softcap=cap)
    want = paged_attention_torch(q, caches[2], caches[3], meta(), d ** -0.5, softcap=cap)
    results = {"attention": (got, want)}
    x, r, w = rnd(5, 96), rnd(5, 96), rnd(96)
    r2 = r.clone()
    results["add + RMSNorm"] = (kern.add_rms_norm(x, r, w, 1e-6), (r2.add_(x), rms_norm(r2, w, 1e-6))[1])
    gu = rnd(5, 2 * 96)
    results["SiLU * up"] = (kern.silu_mul(gu), elementwise.silu_mul(gu))
    results["GELU-tanh * up"] = (kern.gelu_tanh_mul(gu), elementwise.gelu_tanh_mul(gu))
    logits = rnd(3, 1000) * 4  # |result| < 5: the absolute tolerances stay above an fp16/bf16 ulp
    results["softcap"] = (kern.softcap(logits, 5.0), elementwise.softcap(logits, 5.0))
    rope = RotaryEmbedding(d, 64, 10000.0, None, dtype)
    rope.cos, rope.sin = rope.cos.to(device), rope.sin.to(device)
    pos = torch.arange(5, device=device) * 7
    qr, kr = rnd(5, 2, d), rnd(5, 1, d)
    want_q, _ = apply_rotary(qr.clone(), kr.clone(), *rope.table(pos))
    results["rotary"] = (kern.rotary(qr, kr, kern.prepare_rotary(rope, pos))[0], want_q)
    for name, (a, b) in results.items():
        err = (a.float() - b.float()).abs().max().item()
        if not err < tol:  # NaN fails too
            return f"{name} differs from the reference by {err:.2e} (tolerance {tol:.0e})"
    return None


def _scaled_mm_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The start-up checks' rows x [37, 200] (one all zero: scale 1), weight [96, 200] and bias [96]."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 200, generator=g) * 3).to(device)
    x[5] = 0
    w = torch.randn(96, 200, generator=g).to(device)
    bias = torch.randn(96, generator=g).to(device)
    return x, w, bias


def check_scaled_mm(device: torch.device) -> str | None:
    """None when the Triton W8A8 kernels (kernels/triton/scaled_mm.py) equal the references on `device`: row
    codes and scales bitwise, the int8 matmul bitwise in fp32 (exact int32 sums, the same rescale), and in
    bfloat16 within one ulp; else what differs. kernels/linear_int8.py runs it once per device."""
    from batchjob.kernels.reference import scaled_mm as ref
    from batchjob.kernels.triton import scaled_mm as tri

    x, w, bias = _scaled_mm_inputs(device)
    wq, ws = ref.quantize_weight_int8(w)
    q, s = tri.quantize_rows_int8(x)
    rq, rs = ref.quantize_rows_int8(x)
    if not (torch.equal(q, rq) and torch.equal(s, rs)):
        return "int8 row quantization differs from the reference"
    for dtype in (torch.float32, torch.bfloat16):
        got, want = tri.int8_scaled_mm(q, s, wq, ws, bias, dtype), ref.int8_scaled_mm(rq, rs, wq, ws, bias, dtype)
        err = (got.float() - want.float()).abs().max().item()
        if not (torch.equal(got, want) or (dtype == torch.bfloat16 and err <= want.float().abs().max().item() / 128)):
            return f"int8 scaled matmul ({str(dtype).removeprefix('torch.')}) differs from the reference by {err:.2e}"
    return None


def check_scaled_mm_fp8(device: torch.device) -> str | None:
    """None when the Triton fp8 kernels (kernels/triton/scaled_mm.py) agree with the references on `device`: row
    codes and scales bitwise (a GPU's fp32 -> e4m3 cast rounds to nearest even, as torch's does), the fp8 matmul
    within fp32 rounding of the reference's float64 sums (1e-5 of the largest result: the GPU sums in its own
    order) in fp32, and in bfloat16 within one ulp of that; else what differs. kernels/linear_fp8.py runs it once
    per device. Not run on a GPU so far (kernels/linear_fp8.py); under the Triton interpreter the codes differ
    (its emulated e4m3 cast, tests/kernels/triton_cases.py fp8_scaled_mm_case), so this check fails there."""
    from batchjob.kernels.reference import scaled_mm as ref
    from batchjob.kernels.triton import scaled_mm as tri

    x, w, bias = _scaled_mm_inputs(device)
    wq, ws = ref.quantize_weight_fp8(w)
    q, s = tri.quantize_rows_fp8(x)
    rq, rs = ref.quantize_rows_fp8(x)
    if not (torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)):
        return "fp8 row quantization differs from the reference"
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1 / 128 + 1e-5)):
        got, want = tri.fp8_scaled_mm(rq, rs, wq, ws, bias, dtype), ref.fp8_scaled_mm(rq, rs, wq, ws, bias, dtype)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= want.float().abs().max().item() * tol:  # NaN fails too
            return f"fp8 scaled matmul ({str(dtype).removeprefix('torch.')}) differs from the reference by {err:.2e}"
    return None


W4A16_TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # of the largest result: the
# weights rounded to the activations' dtype (fp32: an ieee dot, sums in another order), and the output's cast


def check_w4a16(device: torch.device) -> str | None:
    """None when the Triton W4A16 kernel (kernels/triton/w4a16.py) agrees with the reference (kernels/reference/w4a16.py)
    on `device`: symmetric groups of 128 (two k tiles of 64 per group) and groups of 32 with mins (a k tile of 32 per
    group), 37 rows (two row tiles) x 200 outputs (a partial column tile), with a bias, in fp32, fp16 and bf16, within
    W4A16_TOLERANCE of the largest result; else what differs. kernels/linear_w4a16.py runs it once per device."""
    from batchjob.kernels.reference import w4a16 as ref
    from batchjob.kernels.triton import w4a16 as tri

    g = torch.Generator().manual_seed(0)
    n, k = 200, 256
    for group, with_mins in ((128, False), (32, True)):
        u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(k // group, n, generator=g) * 0.02 + 1e-3
        mins = -scales * torch.randint(0, 16, scales.shape, generator=g) if with_mins else None
        x, bias = torch.randn(37, k, generator=g), torch.randn(n, generator=g)
        qweight = ref.pack_int4(u).to(device)
        args = (scales.to(device), None if mins is None else mins.to(device), group, bias.to(device))
        for dtype, tol in W4A16_TOLERANCE.items():
            xd = x.to(dtype).to(device)
            got, want = tri.w4a16_matmul(xd, qweight, *args).float(), ref.w4a16_matmul(xd, qweight, *args).float()
            err = (got - want).abs().max().item()
            if not err <= tol * want.abs().max().item():  # NaN fails too
                return (f"W4A16 matmul (group {group}{', mins' if with_mins else ''}, {str(dtype).removeprefix('torch.')}) "
                        f"differs from the reference by {err:.2e}")
    return None
