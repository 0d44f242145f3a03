"""The CPU measurement script (ssd_chat/cpu_perf.py, cpu_perf_drafts.py): the estimates and the
summary by hand, and a short real run on the packaged model with a fake llama-bench."""

from __future__ import annotations

import json
import sys

import pytest

from ssd_chat import cpu_perf, cpu_perf_drafts

from test_llamacpp import FAKE


def test_estimates_follow_the_formulas():
    d = {"rows_1": 5.0, "rows_2": 7.0, "rows_3": 8.0, "rows_4": 9.0, "rows_5": 10.0, "rows_6": 12.0}
    v = {1: 20.0, 2: 30.0, 3: 32.0, 4: 34.0, 5: 36.0}
    est = {e["k"]: e for e in cpu_perf_drafts.estimates(0.5, d, v)}
    assert est[2]["tokens_per_round"] == 1.75  # 1 + a + a^2
    assert est[2]["sd_tok_per_s"] == round(1e3 * 1.75 / (2 * 5.0 + 32.0), 1)
    # the speculator's round (glue of k+1 rows + k tree steps) is longer than the verify here
    assert est[2]["speculator_ms_per_round"] == 8.0 + 2 * 12.0
    assert est[2]["ssd_tok_per_s"] == round(1e3 * 1.75 / 32.0, 1)
    assert est[4]["speculator_ms_per_round"] == 10.0 + 4 * 12.0 and est[4]["ssd_tok_per_s"] == round(1e3 * 1.9375 / 58.0, 1)
    assert cpu_perf_drafts.estimates(1.0, d, v)[0]["tokens_per_round"] == 2


def test_summary_states_load_ratio_and_bound():
    res = {"machine": {"cpu": "X", "cores": [0, 1]}, "load_start": 0.1, "load_end": 0.2,
           "start": {"gguf_MB": 96.4}, "bandwidth": {"GB_per_s": 24.1},
           "ar": [{"row_attention": True, "tok_per_s_cpu": 40.0, "tok_per_s_wall": 39.0, "load": 0.1}],
           "app": [{"precision": "gguf Q4_1", "tok_per_s_cpu": 32.0, "cpu_ms_per_token": 31.25, "load": 0.2}],
           "llama": {"t1": {"tok_per_s_by_cpu": 64.0, "tok_per_s": 60.0}, "t2": {"tok_per_s": 100.0, "load": 0.3}},
           "accuracy": {"greedy_agreement": "256/256", "logits_max_abs_diff": 1.8e-4},
           "drafts": {"best_ssd": {"draft": "trained", "k": 2, "ssd_tok_per_s": 80.0}}}
    lines = cpu_perf.summary(res)
    text = "\n".join(lines)
    assert "load average 0.1 -> 0.2" in text and "96.4 MB per forward / 24.1 GB/s = 4.00 ms" in text
    assert "40.0 tok/s by CPU time (39.0 wall, load 0.1); llama.cpp -t 1: 64.0 tok/s by CPU time (60.0 wall): 0.62x" in text
    assert "greedy agreement 256/256, logits max abs diff 1.80e-04" in text
    assert "app AR (gguf Q4_1), 1 thread: 32.0 tok/s by CPU time (31.25 ms per token, load 0.2); 0.50x llama.cpp -t 1" in text
    assert "draft trained, k=2): 80.0 tok/s; llama.cpp -t 2 on cores 0,1: 100.0 tok/s wall (load 0.3): 0.80x" in text


def test_unknown_section_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cpu_perf.main(["--sections", "ar,nope"])
    assert e.value.code == 2 and "unknown section(s) nope" in capsys.readouterr().err


@pytest.fixture
def restored_pinning():
    """cpu_perf pins every thread of its process to core 0 at one torch thread (it is a command of its
    own); in the test process that would leave later tests, SSD's placement among them, on one core."""
    import os

    import torch

    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:
            pass


@pytest.mark.slow
@pytest.mark.usefixtures("restored_pinning")
def test_a_short_run_on_the_packaged_model(smollm2, tmp_path, capsys):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    assert cpu_perf.main(["--sections", "bandwidth,ar,app,accuracy,llama", "--tokens", "4", "--reps", "2",
                          "--llama-bench", str(fake), "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["start"]["gguf_MB"] < 100 and res["bandwidth"]["GB_per_s"] > 0
    assert [r["row_attention"] for r in res["ar"]] == [False, True] and all(r["tok_per_s_cpu"] > 0 for r in res["ar"])
    assert res["accuracy"]["greedy_agreement"].endswith("/256")
    assert [r["precision"] for r in res["app"]] == ["gguf Q4_1", "float32"] and res["app_same_tokens"] is True
    assert res["llama"]["t1"]["tok_per_s"] == 50.0 and res["llama"]["t2"]["cores"] == [0, 1]
    printed = capsys.readouterr().out
    assert "llama.cpp -t 1" in printed and "bound:" in printed


def test_bench_timing_warms_up_then_interleaves():
    """core_bench's and tp_bench's timing: one warm-up call per path, then one call of each per repetition."""
    from ssd_chat import core_bench, tp_bench

    calls: list[str] = []
    paths = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    out = tp_bench.timed(paths, 3)
    assert tp_bench.timed is core_bench.timed
    assert calls == ["a", "b"] * 4
    assert set(out) == {"a ms", "b ms"} and all(v >= 0 for v in out.values())
