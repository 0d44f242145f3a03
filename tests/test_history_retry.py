"""A chat history that another program locks for a while: what is written meanwhile is kept and saved,
in order, once the lock goes (said once); the start's warning shows once; reading commands open the
file read-only, so a read-only folder or a full disk does not stop them."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import TESTS
from helpers.history import chat_db, lock, release
from helpers.tui import FakeBackend, ready, replies_text, ssd_events, submit, wait_until

from ssd_chat.cli import app as cli_app  # noqa: E402
from ssd_chat.history.store import History  # noqa: E402
from ssd_chat.history.files import Pending  # noqa: E402
from ssd_chat.tui.app import ChatApp  # noqa: E402


def saved(path: Path, cid: int) -> list[str]:
    h = History(path)
    try:
        return [m.content for m in h.messages(cid)]
    finally:
        h.close()


# -- the store ---------------------------------------------------------------------------------
def test_writes_made_while_locked_are_saved_in_order_once_the_lock_goes(tmp_path):
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    cid = h.new_conversation("first")
    h.add_message(cid, "user", "first")
    mid = h.add_message(cid, "assistant", "", status="streaming")
    other = lock(path)
    try:
        h.update_message(mid, "an answer", "done")
        cid2 = h.new_conversation("second chat")
        m2 = h.add_message(cid2, "user", "q2")
        h.update_message(mid, "an answer, edited", "done")
        h.retry(force=True)  # still locked: nothing is lost, nothing is said yet
        assert h.warning and "locked" in h.warning and "saved when the file takes writes again" in h.warning
        assert h.resumed is None
    finally:
        release(other)
    assert saved(path, cid) == ["first", ""]
    h.retry(force=True)
    assert h.warning is None and h.is_persistent
    assert h.resumed and "saving the chat history" in h.resumed and "again" in h.resumed
    assert saved(path, cid) == ["first", "an answer, edited"]
    assert saved(path, cid2) == ["q2"] and History(path).messages(cid2)[0].id == m2  # the ids the app holds
    h.add_message(cid2, "assistant", "a2")  # straight into the file from now on
    assert saved(path, cid2) == ["q2", "a2"]
    assert [c.title for c in History(path).list_conversations()] == ["second chat", "first"]


def test_a_chat_whose_ids_another_program_took_meanwhile_stays_in_memory(tmp_path):
    """The replay never writes into another chat: it fails as a whole and the chat stays in memory."""
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    h.new_conversation("first")
    other = lock(path)
    cid = h.new_conversation("mine")  # held back, with the id the file will give the other program
    h.add_message(cid, "user", "mine")
    other.execute("INSERT INTO conversations(title, created_at, updated_at) VALUES ('theirs', 0, 0)")
    other.commit()
    other.close()
    h.retry(force=True)
    assert h.warning and "another program saved chats with the ids this chat uses" in h.warning
    assert [m.content for m in h.messages(cid)] == ["mine"]  # the session still has it
    assert h.add_message(cid, "assistant", "still here") is not None
    in_file = History(path)
    assert sorted(c.title for c in in_file.list_conversations()) == ["first", "theirs"] and in_file.messages(cid) == []


def test_the_back_off_doubles_up_to_its_limit():
    now = [100.0]
    p = Pending(first_s=0.5, max_s=2.0, clock=lambda: now[0])
    assert not p.is_due()
    now[0] += 0.5
    assert p.is_due()
    waits = []
    for _ in range(4):
        p.backoff()
        waits.append(p.wait_s)
        assert not p.is_due()
    assert waits == [1.0, 2.0, 2.0, 2.0]


# -- the app -----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_app_says_once_when_saving_resumes_and_saves_the_whole_chat(tmp_path):
    path = tmp_path / "h.db"
    app = ChatApp(FakeBackend([ssd_events(["one"]), ssd_events(["two"]), ssd_events(["three"])]),
                  history=History(path, timeout_s=0.1))
    async with ready(app, size=(120, 40)) as pilot:
        await submit(pilot, app, "first")
        other = lock(path)
        try:
            await submit(pilot, app, "second")
        finally:
            release(other)

        def notices(word):
            return [n.text for n in app.query(".notice") if word in n.text]

        await wait_until(pilot, lambda: notices("saving the chat history"))  # when idle, too
        await submit(pilot, app, "third")
        assert replies_text(app) == ["one", "two", "three"]
        assert len(notices("could not write the chat history")) == 1
        assert len(notices("saving the chat history")) == 1
        assert saved(path, app.chat_view.conversation_id) == ["first", "one", "second", "two", "third", "three"]
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_the_warning_about_a_locked_database_at_the_start_shows_once(tmp_path):
    path = chat_db(tmp_path / "h.db", n=1)
    other = lock(path, readers_too=True)
    try:
        app = ChatApp(FakeBackend([ssd_events(["one"]), ssd_events(["two"])]), history=History(path, timeout_s=0.1))
        async with ready(app, size=(120, 40)) as pilot:
            for prompt in ("first", "second"):
                await submit(pilot, app, prompt)
            warnings = [n.text for n in app.query(".notice") if "could not open the chat history" in n.text]
            assert len(warnings) == 1, warnings
            await pilot.press("ctrl+c")
        assert app.return_code == 0
    finally:
        release(other)


def finished_in_file(path: Path) -> int:
    """The replies the file holds as finished, read as another program would, beside the app's writes."""
    try:
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=5.0)
    except sqlite3.Error:
        return 0
    try:
        return db.execute("SELECT count(*) FROM messages WHERE role='assistant' AND status='done'").fetchone()[0]
    except sqlite3.Error:  # not made yet
        return 0
    finally:
        db.close()


def test_the_apps_own_write_sequence_across_a_lock_loses_no_turn(tmp_path):
    """The writes the app makes for each turn (replies.py: the question, the reply added as streaming
    after it by id, saved while streaming, its metrics, then its final text), with the file locked from
    the second turn's question until the third's: every turn is in the file, in order."""
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    cid = h.new_conversation("q1")
    other = None
    for turn in range(1, 5):
        if turn == 2:
            other = lock(path)
        if turn == 3:
            release(other)
            other = None
            h.retry(force=True)  # as the app's idle retry does once the back-off is due
            assert h.resumed and h.is_persistent
        q = h.add_message(cid, "user", f"q{turn}")
        a = h.add_message(cid, "assistant", "", status="streaming", parent=q)
        h.update_message(a, f"a{turn} so far", "streaming")
        h.save_metrics(a, {"mode": "ssd", "new_tokens": 3}, "target", "draft")
        h.update_message(a, f"a{turn}", "done")
        if turn == 2:
            assert h.warning and "saved when the file takes writes again" in h.warning
            assert saved(path, cid) == ["q1", "a1"]
    h.close()
    in_file = History(path)
    msgs = in_file.messages(cid)
    assert [(m.role, m.content, m.status) for m in msgs] == [
        (role, f"{letter}{i}", "done") for i in range(1, 5) for role, letter in (("user", "q"), ("assistant", "a"))]
    assert all(m.metrics and m.metrics["new_tokens"] == 3 for m in msgs if m.role == "assistant")


def _replayable() -> list[Path]:
    from helpers.history import shipped

    from ssd_chat.chat.recorder import read

    return [p for p in shipped() if len(read(p).turns) >= 3]


@pytest.mark.parametrize("source", _replayable(), ids=lambda p: p.stem)
def test_locked_then_free_again_in_a_real_terminal(tmp_path, source):
    """The real app (a recorded session replayed, no model): another program locks the database after the
    first reply and lets go once the app says it could not write; the app says so once, and the file ends
    up with every turn.  The end is read from the file, not counted on the screen: a terminal app repaints
    its labels, so how often one shows says nothing about how many replies finished."""
    import time

    pytest.importorskip("pexpect")
    from helpers.history import replay_saving_chats
    from helpers.pty import App, app_env

    from ssd_chat.chat.recorder import read

    turns = len(read(source).turns)
    db = tmp_path / "h.db"
    other, released = None, False
    with App([], app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1"), 120,
             command=replay_saving_chats(db, source, 20.0), dimensions=(60, 150)) as app:
        try:
            def saved_again() -> bool:
                nonlocal other, released
                text = "".join(app.raw)
                if other is None and text.count("last reply") >= 1:
                    other = lock(db)
                if other is not None and not released and "could not write the chat history" in text:
                    release(other)
                    released = True
                return released and "saving the chat history" in text and finished_in_file(db) >= turns

            app.until(saved_again, 120)
            if app.child.isalive():
                time.sleep(0.5)
                app.quit(30)
                app.raw.append(app.child.before or "")
        finally:
            if other is not None and not released:
                release(other)
    text = "".join(app.raw)
    assert released and "saving the chat history" in text, text[-3000:]
    assert "Traceback" not in text and app.child.exitstatus == 0, text[-3000:]
    h = History(db)
    [conv] = h.list_conversations()
    msgs = h.messages(conv.id)
    assert [m.role for m in msgs] == ["user", "assistant"] * turns, [(m.role, m.status, m.content[:30]) for m in msgs]
    assert all(m.status == "done" and m.content for m in msgs), [(m.status, m.content[:20]) for m in msgs]


# -- reading commands on a file they cannot write beside ---------------------------------------
def no_shm_possible(path: Path) -> None:
    """A folder where SQLite would make the WAL's -shm file (file permissions do not stop root, who may
    run the tests), so a read-only connection has to read the -wal without one."""
    Path(str(path) + "-shm").mkdir()


def test_reading_commands_show_what_the_write_ahead_log_holds(tmp_path):
    """A -wal file with newer changes than the file (another program has it open), and no -shm file to
    be made: the newest chats are shown, never the file's older state."""
    live = chat_db(tmp_path / "live.db", n=1)
    writer = sqlite3.connect(live)
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("UPDATE conversations SET title = 'renamed'")
    writer.commit()
    copy = tmp_path / "copy"
    copy.mkdir()
    for suffix in ("", "-wal"):
        shutil.copy(str(live) + suffix, copy / ("h.db" + suffix))
    writer.close()
    no_shm_possible(copy / "h.db")
    r = CliRunner().invoke(cli_app, ["chats", "list", "--db", str(copy / "h.db")])
    assert r.exit_code == 0 and "renamed" in r.stdout and "chat 1" not in r.stdout, r.output


def test_reading_an_older_schema_leaves_the_file_as_it_is(tmp_path):
    db = chat_db(tmp_path / "h.db", n=1)
    old = sqlite3.connect(db)
    old.execute("PRAGMA user_version = 2")  # as if written before turn_metrics existed
    old.execute("DROP TABLE turn_metrics")
    old.commit()
    old.close()
    before = db.read_bytes()
    run = CliRunner().invoke
    assert run(cli_app, ["chats", "list", "--db", str(db)]).exit_code == 0
    r = run(cli_app, ["chats", "show", "1", "--db", str(db)])
    assert r.exit_code == 0 and "question 1" in r.stdout
    assert db.read_bytes() == before


UNSHARE = shutil.which("unshare")


def _in_own_mounts(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([UNSHARE, "-rm", "sh", "-ec", script], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(sys.platform != "linux" or UNSHARE is None, reason="needs Linux user namespaces")
@pytest.mark.parametrize("fault", ["read-only folder", "full disk"])
def test_reading_commands_on_a_real_read_only_folder_and_full_disk(tmp_path, fault):
    """The real faults, in a private mount namespace: a read-only bind mount, and a tmpfs filled up."""
    if _in_own_mounts("true").returncode != 0:
        pytest.skip("user namespaces are not allowed here")
    d = tmp_path / "data"
    d.mkdir()
    cli = f"{sys.executable} -m ssd_chat chats"
    if fault == "read-only folder":
        chat_db(d / "h.db", n=2)
        setup = f"mount --bind -o ro {d} {d}; ! touch {d}/probe 2>/dev/null"
    else:
        make = f"PYTHONPATH={TESTS} {sys.executable} -c '" \
               f"from helpers.history import chat_db; from pathlib import Path; chat_db(Path(\"{d}/h.db\"), n=2)'"
        setup = f"mount -t tmpfs -o size=1m tmpfs {d}; {make}; dd if=/dev/zero of={d}/fill bs=4k 2>/dev/null || true"
    r = _in_own_mounts(f"{setup}; {cli} list --db {d}/h.db; {cli} show 2 --db {d}/h.db")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "chat 1" in r.stdout and "question 2" in r.stdout and r.stderr == "", r.stdout + r.stderr


def test_closing_while_still_locked_says_the_chat_was_not_saved(tmp_path):
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    cid = h.new_conversation("first")
    other = lock(path)
    try:
        h.add_message(cid, "user", "held")
        assert "saved when the file takes writes again" in h.warning
        h.close()
        assert h.warning and "locked" in h.warning and "will not be saved" in h.warning
    finally:
        release(other)
    assert saved(path, cid) == []
