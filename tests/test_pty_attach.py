"""``/attach`` in the real app, in a pseudo-terminal, on a tiny model in its engine process: the file is
counted there with the target's tokenizer, its escape sequences reach the screen as visible text (never
obeyed by the terminal), and the saved chat holds the turn as sent."""

from __future__ import annotations

import sqlite3

import pytest

pexpect = pytest.importorskip("pexpect")

from helpers.pty import App, app_env, last_reply

from ssd_chat.chat import attach  # noqa: E402

HOSTILE = "title \x1b]0;pwned\x07 and \x1b[2J cleared? [bold]markup[/bold]\n"


def test_attach_in_a_pty_counts_in_the_engine_process_and_shows_escapes_literally(tmp_path, tiny_dir, smol_tokenizer):  # noqa: F811
    (tmp_path / "hostile.txt").write_text(HOSTILE)
    db = tmp_path / "h.db"
    with App(["--target", str(tiny_dir), "--mode", "ar", "-n", "3", "--compile", "off", "--db", str(db)],
             app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data")), 300, cwd=str(tmp_path)) as app:
        def until(needle: str, seconds: float) -> bool:
            return app.until(lambda: needle in app.screen(), seconds, poll=0.5)

        assert until("AR · ", 240), app.screen()[-2000:]  # loaded: the title names the mode
        app.child.send("/attach hostile.txt\r")
        n = attach.count(smol_tokenizer, attach.Attachment("hostile.txt", HOSTILE).block())
        assert until(f"({n} tokens): it goes with your next message", 60), app.screen()[-2000:]
        app.child.send("hi\r")
        assert app.until(lambda: (last_reply(db) or ("", ""))[1] == "done", 120, poll=0.5)
        assert until("\\x1b]0;pwned\\x07", 10)  # shown as text
        app.quit()
        app.raw.append(app.child.before or "")
    out = "".join(app.raw)
    assert "\x1b]0;pwned" not in out and "\x1b[2J cleared" not in out  # never sent to the terminal as a sequence
    assert app.child.exitstatus == 0
    with sqlite3.connect(db) as con:
        (user,) = con.execute("SELECT content FROM messages WHERE role='user'").fetchone()
    assert user == f"File: hostile.txt\n```\n{HOSTILE.rstrip(chr(10))}\n```\n\nhi"  # the turn as sent, escapes and all
