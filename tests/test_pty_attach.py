"""``/attach`` in the real app, in a pseudo-terminal, on a tiny model in its engine process: the file is
counted there with the target's tokenizer, its escape sequences reach the screen as visible text (never
obeyed by the terminal), and the saved chat holds the turn as sent."""

from __future__ import annotations

import os
import sqlite3
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

from test_models import tiny_dir  # noqa: E402,F401 - a fixture
from test_pty import last_reply, screen_text  # noqa: E402

from ssd_chat.chat import attach  # noqa: E402

HOSTILE = "title \x1b]0;pwned\x07 and \x1b[2J cleared? [bold]markup[/bold]\n"


def test_attach_in_a_pty_counts_in_the_engine_process_and_shows_escapes_literally(tmp_path, tiny_dir, smol_tokenizer):  # noqa: F811
    (tmp_path / "hostile.txt").write_text(HOSTILE)
    db = tmp_path / "h.db"
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), SSD_CHAT_DATA_DIR=str(tmp_path / "data"))
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--target", str(tiny_dir), "--mode", "ar", "-n", "3", "--compile", "off",
                                           "--db", str(db)], cwd=str(tmp_path), env=env, dimensions=(45, 150),
                          encoding="utf-8", codec_errors="replace", timeout=300)
    raw: list[str] = []

    def until(needle: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while needle not in screen_text("".join(raw)) and time.monotonic() < end and child.isalive():
            try:
                raw.append(child.read_nonblocking(1 << 20, timeout=0.5))
            except (pexpect.TIMEOUT, pexpect.EOF):
                pass
        return needle in screen_text("".join(raw))

    try:
        assert until("AR · ", 240), screen_text("".join(raw))[-2000:]  # loaded: the title names the mode
        child.send("/attach hostile.txt\r")
        n = attach.count(smol_tokenizer, attach.Attachment("hostile.txt", HOSTILE).block())
        assert until(f"({n} tokens): it goes with your next message", 60), screen_text("".join(raw))[-2000:]
        child.send("hi\r")
        end = time.monotonic() + 120
        while (last_reply(db) or ("", ""))[1] != "done" and time.monotonic() < end:
            until("never shown", 0.5)
        assert (last_reply(db) or ("", ""))[1] == "done"
        assert until("\\x1b]0;pwned\\x07", 10)  # shown as text
        child.send("\x03")
        child.expect(pexpect.EOF, timeout=60)
        raw.append(child.before or "")
    finally:
        if child.isalive():
            child.terminate(force=True)
    out = "".join(raw)
    assert "\x1b]0;pwned" not in out and "\x1b[2J cleared" not in out  # never sent to the terminal as a sequence
    child.close()
    assert child.exitstatus == 0
    with sqlite3.connect(db) as con:
        (user,) = con.execute("SELECT content FROM messages WHERE role='user'").fetchone()
    assert user == f"File: hostile.txt\n```\n{HOSTILE.rstrip(chr(10))}\n```\n\nhi"  # the turn as sent, escapes and all
