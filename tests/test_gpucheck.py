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
    assert set(eng["modes"]) == {"ar", "sd", "ssd"} and not any("failed" in m for m in eng["modes"].values())
    assert eng["modes"]["sd"]["greedy_equal_ar"] and eng["modes"]["ssd"]["greedy_equal_ar"]
    ssd = eng["modes"]["ssd"]["replies"]
    assert all(r["cache_hit_rate"] > 0 and r["speculator_busy_ms"] > 0 for r in ssd)  # served by the speculator
    assert all(r["tokens_per_round"] > 3 for r in ssd + eng["modes"]["sd"]["replies"])  # models built to agree


@pytest.mark.slow
def test_gpu_check_cpu_smoke_compiled(tmp_path, repo_root):
    """The same with the compiled core (inductor on this CPU: minutes the first time)."""
    r = subprocess.run([sys.executable, "-m", "lab.gpucheck", "--out", str(tmp_path / "gpu"), "--cpu-smoke", "--budget-s", "3000"],
                       cwd=repo_root, capture_output=True, text=True, timeout=3300,
                       env={**os.environ, "SSD_CHAT_CACHE_DIR": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    _check(json.loads((tmp_path / "gpu" / "report.json").read_text()), compiled=True)
