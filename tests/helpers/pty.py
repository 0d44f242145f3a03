"""Helpers for the pty tests: the real app in a pseudo-terminal, the screen as text, what the app saved,
its worker processes (helpers.procs)."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import sys
import time
from typing import Callable

import pexpect

from ssd_chat.engine.config import cache_dir
from ssd_chat.engine.startup import probe

ANSI = re.compile(r"\x1b(\[[0-9;?<>=]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-Za-z]|[=>NOMDEc78])")


def screen_text(raw: str) -> str:
    """The terminal output with escape sequences removed (runs of text stay together)."""
    return ANSI.sub("", raw)


def last_reply(db_path) -> tuple[str, str] | None:
    try:
        with sqlite3.connect(db_path) as db:
            row = db.execute("SELECT content, status FROM messages WHERE role='assistant' ORDER BY id DESC LIMIT 1").fetchone()
    except sqlite3.Error:
        return None
    return row


def turns(db) -> list[tuple[str, dict]]:
    try:
        with sqlite3.connect(db) as c:
            rows = c.execute("""SELECT m.status, t.stats_json FROM messages m JOIN turn_metrics t ON t.message_id = m.id
                                WHERE m.role='assistant' ORDER BY m.id""").fetchall()
    except sqlite3.Error:
        return []
    return [(status, json.loads(s)) for status, s in rows]


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


def app_env(tmp_path, **more: str) -> dict:
    """The environment of an app under test: a colour terminal and a config dir of its own."""
    return dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), **more)


class App:
    """``python -m ssd_chat ARGS`` (or ``exe ARGS``, or ``python COMMAND... ARGS``) in a pseudo-terminal of
    45x150, and all it wrote.  As a context manager it ends the app if a test failed while it ran."""

    def __init__(self, args: list[str], env: dict, timeout: float, *, exe: str | None = None,
                 command: list[str] | None = None, **spawn) -> None:
        cmd, head = (exe, []) if exe else (sys.executable, ["-m", "ssd_chat"] if command is None else command)
        spawn = {"dimensions": (45, 150), "encoding": "utf-8", "codec_errors": "replace", **spawn}
        self.child = pexpect.spawn(cmd, [*head, *args], env=env, timeout=timeout, **spawn)
        self.raw: list[str] = []

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc) -> None:
        if self.child.isalive():
            self.child.terminate(force=True)
        self.child.close()

    def pump(self, seconds: float = 0.05, poll: float = 0.05) -> None:
        """Read what the app writes for ``seconds`` (until it ends)."""
        end = time.monotonic() + seconds
        while True:
            try:
                self.raw.append(self.child.read_nonblocking(1 << 20, timeout=poll))
            except pexpect.TIMEOUT:
                pass
            except pexpect.EOF:
                return
            if time.monotonic() >= end:
                return

    def read(self, timeout: float) -> None:
        """One read of what the app wrote, waiting ``timeout`` seconds at most."""
        try:
            self.raw.append(self.child.read_nonblocking(1 << 20, timeout=timeout))
        except (pexpect.TIMEOUT, pexpect.EOF):
            pass

    def until(self, done: str | Callable[[], object], seconds: float, poll: float = 0.3) -> bool:
        """Read until ``done`` (text on the screen, or a condition) holds, for ``seconds`` at most; it is
        checked after every read (each waits ``poll`` seconds at most)."""
        check = (lambda: done in self.text()) if isinstance(done, str) else done
        end = time.monotonic() + seconds
        while not check() and time.monotonic() < end and self.child.isalive():
            self.read(poll)
        return bool(check())

    def screen(self, since: int = 0) -> str:
        """What it wrote (from ``raw[since]`` on) without escape sequences."""
        return screen_text("".join(self.raw[since:]))

    def text(self, since: int = 0) -> str:
        """:meth:`screen` with each run of white space as one space (a wrapped line reads as one)."""
        return " ".join(self.screen(since).split())

    def send_line(self, line: str) -> int:
        """Type ``line``, then Enter (not one paste); the mark of what is drawn after it (``text(mark)``)."""
        mark = len(self.raw)
        self.child.send(line)
        time.sleep(0.5)
        self.child.send("\r")
        return mark

    def quit(self, timeout: float = 60) -> None:
        """Ctrl+C, and the app ends."""
        self.child.send("\x03")
        self.child.expect(pexpect.EOF, timeout=timeout)
