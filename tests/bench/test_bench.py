"""The benchmark harness itself (issue 7): workloads, token accounting, the report's structure. Not speed."""
from __future__ import annotations

import json

import pytest

from batchjob.bench import report, roofline
from batchjob.bench.models import spec_from_folder
from batchjob.bench.workloads import TOKEN_HIGH, TOKEN_LOW, W3_PREFIX_LEN, Row, Workload, make, w1, w2, w3


def test_workloads_are_seeded_and_in_range():
    assert [r.prompt for r in w1().rows] == [r.prompt for r in w1().rows]
    assert w1().rows != w1(seed=7).rows
    for wl, rows, prompt, out in ((w1(), 64, (16, 256), (16, 256)), (w2(), 256, (32, 512), (1, 512)),
                                  (w3(), 256, (W3_PREFIX_LEN + 8, W3_PREFIX_LEN + 32), (16, 64))):
        assert wl.num_rows == rows
        assert all(prompt[0] <= len(r.prompt) <= prompt[1] for r in wl.rows)
        assert all(out[0] <= r.max_tokens <= out[1] for r in wl.rows)
        assert all(TOKEN_LOW <= t < TOKEN_HIGH for r in wl.rows for t in r.prompt)
        assert wl.useful_tokens == sum(r.max_tokens for r in wl.rows)


def test_w2_lengths_vary_and_w3_shares_a_prefix():
    outs = [r.max_tokens for r in w2().rows]
    assert 45 < sum(outs) / len(outs) < 85  # exponential, mean 64
    assert max(outs) > 4 * min(outs)
    rows = w3().rows
    prefix = rows[0].prompt[:W3_PREFIX_LEN]
    assert all(r.prompt[:W3_PREFIX_LEN] == prefix for r in rows)
    assert len({tuple(r.prompt[W3_PREFIX_LEN:]) for r in rows}) == len(rows)
    with pytest.raises(ValueError, match="unknown workload"):
        make("W9")


@pytest.fixture(scope="module")
def small_workload() -> Workload:
    # ids inside the conftest model's 400-token vocabulary; unequal lengths so static batches pad
    return Workload("t", "test", [Row([5, 6, 7, 8, 9], 3), Row([10, 11], 7), Row(list(range(20, 40)), 1),
                                  Row([50, 51, 52], 5), Row([60] * 9, 2)])


@pytest.mark.parametrize("static", [0, 2])
def test_batchjob_counts_exactly_each_rows_max_tokens(tiny_model_dir, small_workload, static):
    from batchjob.bench.systems import BatchjobRunner

    res = BatchjobRunner(str(tiny_model_dir("llama")), static=static, dtype="float32").run(small_workload)
    assert res.counted == [r.max_tokens for r in small_workload.rows]
    assert sum(res.counted) == res.useful_tokens == small_workload.useful_tokens == 18
    assert [len(t) for t in res.token_times] == res.counted
    assert all(a <= b for t in res.token_times for a, b in zip(t, t[1:]))
    eng = res.extra
    assert eng["steps"] == sum(eng["step_histogram"].values())
    assert 0 <= eng["share"]["outside_model_forward"] < 1
    assert eng["model_forward_s"] <= eng["runner_s"] <= eng["step_s"]


def test_hf_static_counts_useful_tokens_not_padding(tiny_model_dir, small_workload):
    pytest.importorskip("transformers")
    from batchjob.bench.systems import HFStaticRunner

    res = HFStaticRunner(str(tiny_model_dir("llama")), batch=2).run(small_workload)
    assert res.counted == [r.max_tokens for r in small_workload.rows]
    # batches of 2 run to their longest row: (7 + 7) + (5 + 5) + 2
    assert res.computed_tokens == 26 > sum(res.counted)
    assert [len(t) for t in res.token_times] == res.counted


def _raw(system="batchjob", model="tiny", workload="W1", tok_times=((0.5, 0.6, 0.7), (0.5, 0.8))):
    times = [list(t) for t in tok_times]
    extra = {}
    if system.startswith("batchjob"):
        extra = {"steps": 3, "mean_seqs_per_step": 2.0, "mean_tokens_per_step": 4.0, "step_histogram": {"2,6": 1, "2,2": 2},
                 "share": {"steps": 3, "outside_model_forward": 0.2, "outside_runner": 0.05},
                 "share_at_64": {"steps": 1, "outside_model_forward": 0.08, "outside_runner": 0.01}}
    return {"system": system, "model": model, "workload": workload, "rows": len(times), "dtype": "bfloat16",
            "threads": 2, "load_s": 1.0, "startup_s": 3.0, "peak_rss_mb": 500.0,
            "useful_tokens": sum(len(t) for t in times), "counted": [len(t) for t in times], "token_times": times,
            "gen_s": 1.0, "computed_tokens": 5, "extra": extra}


def test_report_rows_targets_and_json(tmp_path, tiny_model_dir):
    spec = spec_from_folder("tiny", tiny_model_dir("llama"))
    table = {"model": "tiny", "dtype": "bfloat16", "flops": {1: 1e9, 16: 1e10, 64: 4e10}, "ceiling_tok_s": {}}
    assert roofline.flops_at(table, 16) == 1e10
    assert 1e10 < roofline.flops_at(table, 32) < 4e10

    bj = report.summarize(_raw(), spec, {"tiny/bfloat16": table})
    assert bj["output_tokens"] == bj["useful_tokens"] == 5 and bj["tokens_ok"]
    assert bj["tok_s"] == 5.0 and bj["process_s"] == 4.0
    assert bj["per_row"]["ttft_s"] == [0.5, 0.5]
    assert bj["ttft_s"]["p50"] == 0.5 and bj["itl_s"]["p99"] == pytest.approx(0.3)
    ceiling = roofline.flops_at(table, 2.0) / (2 * spec.matmul_params)  # the run's mean: 2 rows per step
    assert bj["roofline"]["at_mean_batch_tok_s"] == pytest.approx(ceiling)
    assert bj["roofline"]["fraction"] == pytest.approx(5.0 / ceiling)
    static = report.summarize(_raw("batchjob-static16", workload="W2"), spec, {})
    cont = report.summarize(_raw(workload="W2", tok_times=((0.1, 0.2, 0.3), (0.1, 0.2))), spec, {})
    hf = report.summarize(_raw("hf-static16", tok_times=((1.0, 2.0, 3.0), (1.0, 2.0))))
    rows = [bj, static, cont, hf, report.failed_row("vllm", "tiny", "W1", "skipped: run make bench-peers")]

    tgts = {t["target"]: t for t in report.targets(rows, None)}
    assert tgts["batchjob / HF generate static 16"]["value"] == pytest.approx(1.0)
    assert tgts["batchjob continuous / static 16 on W2 (tiny)"]["value"] == pytest.approx(1.0)
    assert tgts["outside-the-forward share at 64 running rows (tiny)"]["met"] is True
    assert tgts["batchjob / vLLM-CPU, generation only"]["met"] is None  # not measured, not failed

    text = report.table(rows)
    assert "skipped: run make bench-peers" in text and "hf-static16" in text
    path = tmp_path / "results.json"
    report.write_json(path, {"results": rows, "targets": list(tgts.values())})
    back = json.loads(path.read_text())
    assert {"system", "model", "workload", "tok_s", "ttft_s", "itl_s", "peak_rss_mb", "roofline"} <= set(back["results"][0])
    assert back["results"][-1]["status"].startswith("skipped")


def test_chart_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [report.summarize(_raw()), report.summarize(_raw("hf-static16"))]
    assert report.chart(tmp_path / "c.png", rows) is None
    assert (tmp_path / "c.png").stat().st_size > 1000


@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_decode_profile_splits_a_step_into_op_groups(tiny_model_dir, kernels):
    from batchjob.bench.decode_profile import GROUPS, profile_decode, summary_line

    p = profile_decode(str(tiny_model_dir("llama", max_positions=1024)), kernels, rows=4, steps=2, warm_steps=1,
                       dtype="float32")
    assert p["rows"] == 4 and p["step_ms"] > 0 and p["mean_context"] > 16
    assert set(p["shares"]) == {*GROUPS, "other"} and abs(sum(p["shares"].values()) - 1) < 1e-6
    assert p["shares"]["attention"] > 0 and p["shares"]["linear"] > 0
    assert p["kernels"] in summary_line(p)
