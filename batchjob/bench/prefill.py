"""`make bench`'s prefill-only rows (docs/guide/embeddings.md, docs/guide/scoring.md): a 1,000-row embedding job
and a 1,000-row scoring job (prompt + continuation, lm-evaluation-harness's loglikelihood) on SmolLM2-135M,
batchjob (`LLM.embed` / `LLM.score`: bf16, default kernels, the model loaded once) against HF transformers (one
batched forward per 32 rows of similar length, padded on the right with an attention mask, fp32 as HF runs on a CPU; the same
pooling and the same log-softmax gather). Prompt tokens per second, alternating runs in one process, best of N.

    python -m batchjob.bench.prefill [--rows 1000] [--repeats 2] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from batchjob.bench.paths import PROMPTS

HF_BATCH = 32


def texts(n: int) -> tuple[list[str], list[str]]:
    """n prompts (the shipped sample prompts, numbered) and a continuation for each."""
    lines = [json.loads(x)["prompt"] for x in PROMPTS.read_text().splitlines() if x.strip()]
    prompts = [f"Question {i}: {lines[i % len(lines)]}" for i in range(n)]
    answers = [" The answer is yes.", " It depends on the context.", " Paris.", " I do not know."]
    return prompts, [answers[i % len(answers)] for i in range(n)]


def _by_length(tok, texts_: list[str]) -> list[int]:
    """Row order for HF's batches: by token count, as sentence-transformers batches (padding to the longest of
    a batch of similar rows, not of the shipped prompts' 9-to-299-token spread)."""
    return sorted(range(len(texts_)), key=lambda i: len(tok(texts_[i])["input_ids"]))


def hf_embed(model, tok, prompts: list[str]) -> list[torch.Tensor]:
    order, out = _by_length(tok, prompts), [None] * len(prompts)
    with torch.no_grad():
        for i in range(0, len(order), HF_BATCH):
            rows = order[i:i + HF_BATCH]
            enc = tok([prompts[j] for j in rows], return_tensors="pt", padding=True)
            h = model(**enc).last_hidden_state
            last = enc["attention_mask"].sum(1) - 1  # padded on the right: each row's last real token
            for j, v in zip(rows, F.normalize(h[torch.arange(h.shape[0]), last].float(), dim=-1)):
                out[j] = v
    return out


def hf_score(model, tok, prompts: list[str], conts: list[str]) -> list[float]:
    order, out = _by_length(tok, [p + c for p, c in zip(prompts, conts)]), [None] * len(prompts)
    with torch.no_grad():
        for i in range(0, len(order), HF_BATCH):
            rows = order[i:i + HF_BATCH]
            ctx = [tok(prompts[j])["input_ids"] for j in rows]
            whole = [tok(prompts[j] + conts[j])["input_ids"] for j in rows]
            width = max(map(len, whole))
            ids = torch.tensor([w + [0] * (width - len(w)) for w in whole])
            mask = torch.tensor([[1] * len(w) + [0] * (width - len(w)) for w in whole])
            lsm = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), dim=-1)
            for r, (j, c, w) in enumerate(zip(rows, ctx, whole)):
                pos = torch.arange(len(c), len(w))
                out[j] = lsm[r, pos - 1, torch.tensor(w[len(c):])].sum().item()
    return out


def measure(rows: int = 1000, repeats: int = 2, log=print) -> dict:
    import transformers as tf

    from batchjob.api import LLM
    from batchjob.bench.models import prepare

    folder = Path(prepare("smollm2").path)
    prompts, conts = texts(rows)
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_gb=1.0)
    tok = tf.AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "right"
    tok.pad_token = tok.pad_token or tok.eos_token
    base = tf.AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    lm = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm.embed(prompts[:8])  # warm: kernels compiled, engine built
    runs: dict[str, list[float]] = {k: [] for k in ("batchjob_embed", "hf_embed", "batchjob_score", "hf_score")}
    tokens = {}
    agree = {}
    for _ in range(repeats):
        t0 = time.perf_counter()
        ours = llm.embed(prompts)
        runs["batchjob_embed"].append(time.perf_counter() - t0)
        tokens["embed"] = sum(r.prompt_tokens for r in ours)
        t0 = time.perf_counter()
        theirs = hf_embed(base, tok, prompts)
        runs["hf_embed"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        scored = llm.score(prompts, conts)
        runs["batchjob_score"].append(time.perf_counter() - t0)
        tokens["score"] = sum(r.prompt_tokens for r in scored)
        t0 = time.perf_counter()
        ref_scores = hf_score(lm, tok, prompts, conts)
        runs["hf_score"].append(time.perf_counter() - t0)
        agree["embed_min_cosine"] = round(min(float(torch.dot(torch.tensor(a.embedding), b)) for a, b in zip(ours, theirs)), 4)
        agree["score_max_abs_diff"] = round(max(abs(a.continuation_logprob - b) for a, b in zip(scored, ref_scores)), 4)
    out = {"rows": rows, "repeats": repeats, "batchjob_dtype": "bfloat16", "hf_dtype": "float32", "hf_batch": HF_BATCH,
           "kernels": llm.kernels, "agreement_bf16_vs_hf_fp32": agree}
    for task in ("embed", "score"):
        for system in ("batchjob", "hf"):
            best = min(runs[f"{system}_{task}"])
            out[f"{system}_{task}"] = {"best_s": round(best, 2), "prompt_tokens_s": round(tokens[task] / best)}
        out[f"{task}_speedup"] = round(out[f"hf_{task}"]["best_s"] / out[f"batchjob_{task}"]["best_s"], 2)
    log(text(out))
    return out


def text(r: dict) -> str:
    lines = []
    for task in ("embed", "score"):
        b, h = r[f"batchjob_{task}"], r[f"hf_{task}"]
        lines.append(f"  {task:5s} {r['rows']:,} rows: batchjob {b['prompt_tokens_s']:,} prompt tok/s ({b['best_s']} s), "
                     f"HF transformers {h['prompt_tokens_s']:,} ({h['best_s']} s): {r[f'{task}_speedup']}x")
    a = r["agreement_bf16_vs_hf_fp32"]
    lines.append(f"  bf16 vs HF fp32: embeddings min cosine {a['embed_min_cosine']}, continuation logprob max |diff| "
                 f"{a['score_max_abs_diff']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    r = measure(args.rows, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
