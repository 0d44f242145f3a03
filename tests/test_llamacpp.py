"""`ssd-chat bench --against llama.cpp PATH` (ssd_chat/llamacpp.py) with a fake llama-bench: the
command it runs, the cores it pins, the JSON it reads, the ratios, and one-line errors.  CI never
needs llama.cpp itself."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ssd_chat.bench import llamacpp
from ssd_chat.bench.protocols import Hardware, make_plans
from ssd_chat.cli import app
from ssd_chat.bench.llamacpp import LlamaCppError
from helpers.cli import FAKE

@pytest.fixture
def fake_bench(tmp_path: Path) -> Path:
    path = tmp_path / "build" / "bin" / "llama-bench"
    path.parent.mkdir(parents=True)
    path.write_text(FAKE.format(python=sys.executable))
    path.chmod(0o755)
    return path


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    return p


def test_runs_tg_with_the_token_count_threads_and_json(fake_bench, gguf, tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    core = min(os.sched_getaffinity(0))
    res = llamacpp.run_tg(fake_bench, gguf, n_gen=24, threads=1, cores=(core,), repetitions=2)
    assert res.tok_per_s == 50.0 and res.stddev == 1.5 and res.threads == 1 and res.n_gen == 24
    assert res.build == "abc1234 (42)" and res.cores == (core,)
    call = json.loads(log.read_text())
    assert call["args"] == ["-m", str(gguf), "-p", "0", "-n", "24", "-t", "1", "-r", "2", "-o", "json"]
    assert call["cores"] == [core]  # pinned like the bench's own modes
    assert "llama-bench tg24, core" in res.describe() and "50.0 ± 1.5 tok/s" in res.describe()


def test_a_build_folder_is_searched(fake_bench, gguf):
    assert llamacpp.find_binary(fake_bench.parent.parent.parent) == fake_bench
    assert llamacpp.run_tg(fake_bench.parent.parent.parent, gguf, 8, 2).tok_per_s == 100.0


@pytest.mark.parametrize("mode, message", [
    ("fail", r"llama-bench failed \(exit status 1\): llama_model_load: error loading model"),
    ("garbage", r"printed no JSON results"),
])
def test_a_broken_run_is_one_line(fake_bench, gguf, monkeypatch, mode, message):
    monkeypatch.setenv("FAKE_LLAMA_MODE", mode)
    with pytest.raises(LlamaCppError, match=message) as e:
        llamacpp.run_tg(fake_bench, gguf, 8, 1)
    assert "\n" not in str(e.value)


def test_a_hanging_run_is_killed(fake_bench, gguf, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_MODE", "hang")
    with pytest.raises(LlamaCppError, match="did not finish within 1 s"):
        llamacpp.run_tg(fake_bench, gguf, 8, 1, timeout_s=1)


def test_missing_or_wrong_binaries(tmp_path, gguf, fake_bench):
    with pytest.raises(LlamaCppError, match="llama-bench not found: '.*nope' does not exist"):
        llamacpp.find_binary(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LlamaCppError, match="no llama-bench in"):
        llamacpp.find_binary(empty)
    plain = tmp_path / "not-exec"
    plain.write_text("#!/bin/sh\n")
    with pytest.raises(LlamaCppError, match="is not an executable file"):
        llamacpp.find_binary(plain)
    with pytest.raises(LlamaCppError, match="GGUF file '.*missing.gguf' does not exist"):
        llamacpp.run_tg(fake_bench, tmp_path / "missing.gguf", 8, 1)


def test_parse_needs_the_tg_entry():
    pp_only = json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 900.0}])
    with pytest.raises(LlamaCppError, match="no token-generation result for 16 tokens"):
        llamacpp.parse_tg(pp_only, 16)
    assert llamacpp.parse_tg(json.dumps([{"n_prompt": 0, "n_gen": 16, "avg_ts": 3.0}]), 16)["avg_ts"] == 3.0


def test_against_times_each_protocols_ar_placement_and_reports_ratios(fake_bench, gguf, tmp_path, monkeypatch):
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(log))
    hw = Hardware((0, 1), 0)
    plans, _ = make_plans(("paper", "equal"), ("ar", "ssd"), "cpu", "auto", hw)
    report = {"protocols": {"paper": {"modes": {"ar": {"tok_per_s": {"median": 25.0}}, "ssd": {"tok_per_s": {"median": 40.0}}}},
                            "equal": {"modes": {"ar": {"tok_per_s": {"median": 30.0}}, "ssd": {"tok_per_s": {"median": 40.0}}}}}}
    if not {0, 1} <= set(os.sched_getaffinity(0)):
        pytest.skip("needs cores 0 and 1")
    lines = llamacpp.against(fake_bench, gguf, plans, report, 32)
    calls = [json.loads(x) for x in log.read_text().splitlines()]
    assert [c["cores"] for c in calls] == [[0], [0, 1]]  # paper: the target's core, 1 thread; equal: both cores, 2 threads
    assert [c["args"][c["args"].index("-t") + 1] for c in calls] == ["1", "2"]
    got = report["against"]["llama.cpp"]
    assert got["paper"]["ratio_to_llamacpp"] == {"ar": 0.5, "ssd": 0.8}
    assert got["equal"]["ratio_to_llamacpp"] == {"ar": 0.3, "ssd": 0.4}
    assert lines[0].startswith("paper protocol: llama.cpp llama-bench tg32, core 0, 1 thread: 50.0")
    assert "AR 25.0 tok/s = 0.50×, SSD 40.0 tok/s = 0.80×" in lines[0]


def test_check_against_refuses_other_tools_and_non_gguf_targets(fake_bench):
    from ssd_chat.engine.load.models import ModelSpec

    spec = ModelSpec("x", "gguf", "/m.gguf")
    assert llamacpp.check_against("llama.cpp", str(fake_bench), spec) == fake_bench
    with pytest.raises(LlamaCppError, match="the only comparison is 'llama.cpp'"):
        llamacpp.check_against("ollama", str(fake_bench), spec)
    with pytest.raises(LlamaCppError, match="target 'x' is not a .gguf model"):
        llamacpp.check_against("llama.cpp", str(fake_bench), ModelSpec("x", "hub", "org/x"))


def test_cli_checks_the_binary_before_loading_anything(tmp_path):
    r = CliRunner().invoke(app, ["bench", "--dry-run", "--against", "llama.cpp", str(tmp_path / "nope")])
    assert r.exit_code != 0
    assert "llama-bench not found" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["bench", "--dry-run", "--against", "llama.cpp"])
    assert r.exit_code == 2 and "requires 2 arguments" in r.output
