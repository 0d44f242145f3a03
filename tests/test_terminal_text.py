"""Escape sequences in stored chats never reach the terminal: `chats list`, `chats show` and the app
show them as visible text (checked on a real pseudo-terminal's raw output)."""

from __future__ import annotations

import os
import time

import pytest
from typer.testing import CliRunner

from ssd_chat.cli import app as cli_app
from ssd_chat.history.store import History
from ssd_chat.chat.terminal import for_stream, printable

pexpect = pytest.importorskip("pexpect")

from helpers.pty import App, app_env  # noqa: E402

# an OSC window-title change, a CSI colour and a cursor-home, a bell, and a C1 CSI (0x9b)
EVIL = "please \x1b]0;PWNED\x07 set \x1b[31mred\x1b[H now\x07 \x9b2J end"


def evil_db(path):
    h = History(path)
    cid = h.new_conversation(EVIL)
    h.add_message(cid, "user", EVIL)
    h.add_message(cid, "assistant", "reply " + EVIL)
    h.close()
    return path


def test_printable_shows_control_characters_and_keeps_the_rest():
    assert printable(EVIL) == "please \\x1b]0;PWNED\\x07 set \\x1b[31mred\\x1b[H now\\x07 \\x9b2J end"
    assert printable("line 1\n\tline 2 é 中") == "line 1\n\tline 2 é 中"
    assert printable("a\nb\tc", one_line=True) == "a\\nb\\tc"

    class Tty:
        def isatty(self):
            return True

    assert for_stream(EVIL, Tty()) == printable(EVIL)
    assert for_stream(EVIL, open(os.devnull, "w")) == EVIL  # a file or a pipe gets the text as stored


def test_chats_list_escapes_titles(tmp_path):
    db = evil_db(tmp_path / "h.db")
    r = CliRunner().invoke(cli_app, ["chats", "list", "--db", str(db)])
    assert r.exit_code == 0 and "\x1b" not in r.stdout and "\x9b" not in r.stdout
    assert "\\x1b]0;PWNED" in r.stdout
    r = CliRunner().invoke(cli_app, ["chats", "export", "1", "--db", str(db)])  # not a terminal: exact
    assert EVIL in r.stdout


def _env(tmp_path):
    return app_env(tmp_path, COLUMNS="150", LINES="45", SSD_CHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1")


def test_chats_show_on_a_terminal_escapes_what_it_prints(tmp_path):
    db = evil_db(tmp_path / "h.db")
    child = App(["chats", "show", "1", "--db", str(db)], _env(tmp_path), 60).child
    out = child.read()
    child.close()
    assert child.exitstatus == 0, out
    assert "\\x1b]0;PWNED" in out and "reply please" in out
    assert "\x1b]0;PWNED" not in out and "\x1b[31mred" not in out and "\x9b" not in out


def test_the_app_shows_a_resumed_chat_without_obeying_its_escapes(tmp_path):
    """The model cannot load (a model folder without weights), so this needs none; the saved chat shows anyway."""
    db = evil_db(tmp_path / "h.db")
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with App(["--db", str(db), "--resume", "1", "--target", str(model)], _env(tmp_path), 60) as app:
        app.until(lambda: "could not load the model" in "".join(app.raw), 60, poll=0.5)
        time.sleep(0.5)
        app.read(0.5)
        app.quit(30)
        app.raw.append(app.child.before or "")
    out = app.raw
    raw = "".join(out)
    assert "could not load the model" in raw and "PWNED" in raw, raw[-2000:]
    assert "\x1b]0;PWNED" not in raw and "\x1b[31mred" not in raw and "\x9b2J" not in raw


def bad_utf8_db(path):
    """Chat 1's title and chat 2's reply hold escape sequences and bytes that are not UTF-8 (written by
    another program: ssd-chat itself only stores text); chat 3 is fine."""
    import sqlite3

    h = History(path)
    for title, reply in (("one", "r1"), ("two", "r2"), ("three \x1b[31mred", "r3")):
        cid = h.new_conversation(title)
        h.add_message(cid, "user", title)
        h.add_message(cid, "assistant", reply)
    h.close()
    db = sqlite3.connect(path)
    evil = b"\x1b]0;PWNED\x07 \x1b[2J\xff\xfe"  # a title change, a screen clear, then invalid UTF-8
    db.execute("UPDATE conversations SET title = CAST(? AS TEXT) WHERE id = 1", (b"t " + evil,))
    db.execute("UPDATE messages SET content = CAST(? AS TEXT) WHERE id = 4", (b"reply " + evil,))
    db.commit()
    db.close()
    return path


def _no_terminal_control(text):
    return "\x1b" not in text and "\x07" not in text and "\x9b" not in text and "\ufffd" not in text


def test_invalid_utf8_and_escapes_in_the_database_never_reach_the_terminal(tmp_path):
    db = str(bad_utf8_db(tmp_path / "h.db"))
    run = CliRunner().invoke
    r = run(cli_app, ["chats", "list", "--db", db])  # one damaged title does not hide the other chats
    assert r.exit_code == 0 and _no_terminal_control(r.stdout), r.output
    lines = r.stdout.splitlines()
    assert len(lines) == 3 and lines[-1].endswith("t \\x1b]0;PWNED\\x07 \\x1b[2J\\xff\\xfe")
    assert "three \\x1b[31mred" in r.stdout
    for args, what in ((["show", "1"], "chat 1"), (["show", "2"], "chat 2"), (["export", "2", "-f", "jsonl"], "chat 2")):
        r = run(cli_app, ["chats", *args, "--db", db])
        assert r.exit_code == 1 and r.stdout == "", (args, r.output)
        assert r.stderr.startswith(f"ssd-chat: error: could not read {what} ") and r.stderr.count("\n") == 1, r.stderr
        assert "not valid UTF-8" in r.stderr and "PWNED" not in r.stderr and _no_terminal_control(r.stderr), r.stderr
    r = run(cli_app, ["chats", "show", "3", "--db", db])
    assert r.exit_code == 0 and "r3" in r.stdout


def test_chats_commands_on_a_damaged_database_in_a_real_terminal(tmp_path):
    """What the terminal receives, byte for byte: no title change, no screen clear, no raw bytes."""
    db = str(bad_utf8_db(tmp_path / "h.db"))
    for args, code in ((["chats", "list"], 0), (["chats", "show", "1"], 1), (["chats", "show", "2"], 1),
                       (["chats", "show", "3"], 0), (["chats", "export", "3"], 0)):
        child = App([*args, "--db", db], _env(tmp_path), 60, encoding="latin-1").child  # latin-1: every byte as it came
        out = child.read()
        child.close()
        assert child.exitstatus == code, (args, out)
        assert "\x1b]0;" not in out and "\x1b[2J" not in out and "\x1b[31m" not in out and "\x07" not in out, (args, out)
        assert "\xff" not in out and "\x9b" not in out, (args, out)
