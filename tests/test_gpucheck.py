"""The GPU readiness check (.ci/gpu-check, lab/gpucheck.py): no GPU is lent to CI, so its
--cpu-smoke mode runs every step with tiny shapes on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _check(report: dict, compiled: bool) -> None:
    paths = ["transformers", "core eager"] + (["core compiled"] if compiled else [])
    for name in report["forward_names"]:
        for path in paths:
            assert report["forwards"][f"{name} {path} ms"] > 0, (name, path)
    assert report["channel"]["ping_us"] > 0 and report["channel"]["request_us"] > 0
    rounds = report["rounds"]
    assert rounds["path"] == ("core compiled" if compiled else "core eager")
    # the draft identical to the oracle: every round a hit with all k drafts accepted
    assert rounds["identical"]["hit_rate"] == 1.0 and rounds["identical"]["mean_accepted"] == report["k"]
    assert rounds["identical"]["wait_hit_ms"] is not None
    # a heavily perturbed draft misses, and the miss waits include the fallback drafting
    assert rounds["perturbed"]["wait_miss_ms"] is not None and rounds["perturbed"]["hit_rate"] < 1.0
    # the tensor-parallel code path with one rank: same greedy tokens as the core, timed next to it
    tp_paths = ["TP=1 eager"] + (["TP=1 compiled"] if compiled else [])
    assert report["paths"] == paths + tp_paths
    for path in tp_paths:
        assert report["tp"][f"{path} greedy_equal_core"] is True and report["tp"][f"{path} max_abs_logit_diff"] < 1e-3
        for name in ("target 1 row", "target verify"):
            assert report["forwards"][f"{name} {path} ms"] > 0
    assert "TP=2 needs 2 GPUs" in report["tp"]["not_measured"] and report["tp"]["shard"].startswith("rank 0 on cpu")
    # TP=2 (on a GPU machine: NCCL over two GPUs; here two gloo ranks, eager) on the draft-shaped model
    tp2 = report["tp"]
    assert tp2["TP=2 eager greedy_equal_core"] is True and tp2["TP=2 eager first_divergence"] is None
    assert tp2["TP=2 eager max_abs_logit_diff"] < 1e-3 and "TP=2 compiled greedy_equal_core" not in tp2
    assert [s.split(":")[0] for s in tp2["TP=2 eager shards"]] == ["rank 0 on cpu", "rank 1 on cpu"]
    for kind in ("1 row", "verify"):
        assert tp2[f"{kind} TP=2 eager ms"] > 0 and tp2[f"{kind} core eager ms"] > 0
    proj = [r for r in report["projection"] if r["path"] == rounds["path"]]
    assert [r["alpha"] for r in proj] == [0.6, 0.7, 0.8] and all(r["ssd"] > 0 and r["sd"] > 0 and r["ar"] > 0 for r in proj)
    assert not report.get("failed")


def test_gpu_check_cpu_smoke_runs_every_step(tmp_path, repo_root):
    out = tmp_path / "gpu"
    r = subprocess.run(["bash", str(repo_root / ".ci" / "gpu-check"), str(out), "--cpu-smoke", "--compile", "off"],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "SSD_CHAT_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr + (out / "log.txt").read_text()
    _check(json.loads((out / "report.json").read_text()), compiled=False)
    md = (out / "report.md").read_text()
    assert "## Per-forward cost" in md and "Projected tok/s" in md and "paper (Llama-3.1-70B/3.2-1B" in md
    assert "| target 1 row |" in md and "TP=1 eager" in md and "## tp" in md and "TP=2 needs 2 GPUs" in md
    assert "exit 0" in (out / "summary.txt").read_text()
    # the real decoders on the same (here tiny) shapes: the speculator process ran, greedy SD/SSD = AR
    eng = json.loads((out / "engine.json").read_text())
    assert set(eng["modes"]) == {"ar", "sd", "ssd", "two-device/ssd", "tp2/ar", "tp2/sd", "tp2/ssd"}
    assert not any("failed" in m for m in eng["modes"].values())
    assert eng["modes"]["sd"]["greedy_equal_ar"] and eng["modes"]["ssd"]["greedy_equal_ar"]
    ssd = eng["modes"]["ssd"]["replies"]
    assert all(r["cache_hit_rate"] > 0 and r["speculator_busy_ms"] > 0 for r in ssd)  # served by the speculator
    assert all(r["tokens_per_round"] > 3 for r in ssd + eng["modes"]["sd"]["replies"])  # models built to agree
    # the multi-device runs, on pinned cores: the speculator on a device of its own, and TP=2
    assert set(eng["runs"]) == {"shared", "two-device", "tp2"} and eng["skipped"] == []
    two = eng["modes"]["two-device/ssd"]
    assert two["speculator"].startswith("speculator on cpu (cores 1)") and "cores 0" in two["target"]
    assert two["greedy_equal_ar"] and all(r["cache_hit_rate"] > 0 for r in two["replies"])
    for mode in ("ar", "sd", "ssd"):
        tp2 = eng["modes"][f"tp2/{mode}"]
        assert tp2["target"].startswith("tensor-parallel over 2 ranks"), tp2
        assert mode == "ar" or tp2["greedy_equal_ar"], tp2
    assert eng["modes"]["tp2/ssd"]["speculator"].startswith("speculator on cpu (cores 1)")


@pytest.mark.parametrize("gpus, runs, skipped", [
    (0, [], ["no CUDA GPU"]),
    (1, ["shared"], ["two-device (SSD with the speculator on cuda:1): needs 2 GPUs, this machine has 1",
                     "tp2 (the target over cuda:0,cuda:1, the speculator on cuda:2): needs 3 GPUs, this machine has 1"]),
    (2, ["shared", "two-device"], ["needs 3 GPUs, this machine has 2"]),
    (3, ["shared", "two-device", "tp2"], []),
    (8, ["shared", "two-device", "tp2"], []),
])
def test_the_engine_check_plans_the_runs_the_gpus_allow(gpus, runs, skipped):
    """The paper's setup (the speculator on a GPU of its own) with 2 GPUs, TP=2 with 3; on one GPU the
    check says what it skipped and why.  Every planned placement is one the engine accepts."""
    from lab.gpucheck_engine import plan_runs
    from ssd_chat.engine.load.placement import plan_target

    got, why = plan_runs(gpus)
    assert [r.name for r in got] == runs
    assert len(why) == len(skipped) and all(w.endswith(s) for w, s in zip(why, skipped)), why
    by = {r.name: r for r in got}
    if "shared" in by:
        assert (by["shared"].target, by["shared"].draft, by["shared"].modes) == ("cuda:0", "cuda:0", ("ar", "sd", "ssd"))
    if "two-device" in by:  # SSD alone: compared with the shared run's SD and AR on cuda:0
        assert (by["two-device"].target, by["two-device"].draft, by["two-device"].modes) == ("cuda:0", "cuda:1", ("ssd",))
    if "tp2" in by:
        assert (by["tp2"].target, by["tp2"].draft) == ("cuda:0,cuda:1", "cuda:2")
    for r in got:
        tp = plan_target(r.target, r.draft, gpus=gpus)
        assert tp.world == (2 if r.name == "tp2" else 1) and tp.draft_device == r.draft


def test_the_cpu_smoke_plans_every_run_on_pinned_cores_or_says_why_not():
    from lab.gpucheck_engine import plan_runs

    runs, why = plan_runs(0, smoke=True, cores=2)
    assert [(r.name, r.target, r.draft) for r in runs] == [("shared", "cpu", "cpu"), ("two-device", "cpu:0", "cpu:1"),
                                                           ("tp2", "cpu:0,cpu:1", "cpu:1")] and why == []
    runs, why = plan_runs(0, smoke=True, cores=1)
    assert [r.name for r in runs] == ["shared"] and why == ["two-device and tp2 (CPU smoke): need 2 cores, this process may use 1"]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_compiled(tmp_path, repo_root):
    """The same with the compiled core (inductor on this CPU: minutes the first time)."""
    r = subprocess.run([sys.executable, "-m", "lab.gpucheck", "--out", str(tmp_path / "gpu"), "--cpu-smoke", "--budget-s", "3000"],
                       cwd=repo_root, capture_output=True, text=True, timeout=3300,
                       env={**os.environ, "SSD_CHAT_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    _check(json.loads((tmp_path / "gpu" / "report.json").read_text()), compiled=True)
