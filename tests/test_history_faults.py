"""A chat history that fails under the chat (locked, read-only, damaged pages) never stops it:
writes carry on in memory, reads fail with one line, the rest of the history stays usable."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers.tui import FakeBackend, ready, replies_text, ssd_events, submit, wait_until

from ssd_chat.cli import app as cli_app  # noqa: E402
from ssd_chat.history.store import History, HistoryError  # noqa: E402
from ssd_chat.tui.app import ChatApp  # noqa: E402
from helpers.history import chat_db, lock, release


def damage_reply_pages(path: Path) -> int:
    """Point the first overflow page of the 'Z' reply at a page past the end of the file, as a torn
    or bit-flipped write would; returns the damaged page's number."""
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[16:18], "big")
    for page in range(1, len(data) // size):  # an overflow page: 4-byte next-page number, then payload
        if data[page * size + 4:page * size + 104] == b"Z" * 100:
            data[page * size:page * size + 4] = (1_000_000).to_bytes(4, "big")
            path.write_bytes(bytes(data))
            return page + 1
    raise AssertionError("no overflow page found")


def damaged_chat_list(path: Path, seed: int = 0) -> Path:
    """300 random bytes over the end of page 2, the root page of ``conversations``, where its rows are:
    SQLite still opens the file, but the list of chats no longer reads to its end."""
    import random

    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[16:18], "big")
    data[2 * size - 300:2 * size] = random.Random(seed).randbytes(300)
    path.write_bytes(bytes(data))
    return path


def damaged_db(tmp_path: Path) -> Path:
    path = chat_db(tmp_path / "damaged.db", long_reply_in=2)
    damage_reply_pages(path)
    return path


# -- the store ---------------------------------------------------------------------------------
def test_write_while_another_program_holds_the_lock_goes_on_in_a_memory_copy(tmp_path):
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    cid = h.new_conversation("first")
    h.add_message(cid, "user", "first")
    mid = h.add_message(cid, "assistant", "", status="streaming")
    other = lock(path)  # another ssd-chat, or a sqlite3 shell, mid-transaction
    try:
        h.update_message(mid, "an answer", "done")  # the write that fails: the chat moves to memory
        assert h.warning and "locked" in h.warning and "in memory" in h.warning
        assert h.add_message(cid, "user", "second") is not None  # same conversation id, no IntegrityError
        assert [m.content for m in h.messages(cid)] == ["first", "an answer", "second"]
        assert [c.title for c in h.list_conversations()] == ["first"]
    finally:
        release(other)
    h.close()  # the lock is gone: what was written meanwhile is saved, in order
    assert [m.content for m in History(path).messages(cid)] == ["first", "an answer", "second"]


def test_a_file_that_cannot_be_copied_gives_a_fresh_store_whose_ids_never_clash(tmp_path):
    """When the file can be neither written nor read (here its connection is gone), the chat goes on
    in an empty store; the ids the app still holds must never name one of its new chats."""
    path = tmp_path / "h.db"
    h = History(path, timeout_s=0.1)
    cid = h.new_conversation("first")
    mid = h.add_message(cid, "user", "first")
    h.db.close()
    assert h.add_message(cid, "assistant", "lost") is None  # nothing to copy: this chat is not kept
    assert h.warning and "could not write" in h.warning
    assert h.add_message(cid, "user", "still no crash") is None
    h.update_message(mid, "x", "done")
    fresh = h.new_conversation("after")
    assert fresh is not None and fresh > cid  # an old id can never name this chat
    assert h.add_message(fresh, "user", "kept") > mid
    assert [m.content for m in h.messages(fresh)] == ["kept"]
    assert h.messages(cid) == []


def test_a_database_that_refuses_writes_keeps_a_resumed_chat_going(tmp_path):
    """What a read-only file does to SQLite (``attempt to write a readonly database``), made with
    ``query_only`` because the tests may run as root, for whom file permissions do not apply."""
    path = chat_db(tmp_path / "h.db", n=1)
    h = History(path)
    h.db.execute("PRAGMA query_only = ON")
    assert h.add_message(1, "user", "more") is not None
    assert h.warning and "could not write" in h.warning
    assert [m.content for m in h.messages(1)] == ["question 1", "A" * 20, "more"]


@pytest.mark.skipif(sys.platform == "win32" or __import__("os").geteuid() == 0, reason="root ignores file permissions")
def test_a_read_only_file_opens_as_a_copy(tmp_path):
    path = chat_db(tmp_path / "h.db", n=1)
    path.chmod(0o444)
    tmp_path.chmod(0o555)  # no -wal / -shm either
    try:
        h = History(path)
        assert h.warning and "in memory" in h.warning
        assert h.add_message(1, "user", "more") is not None
        assert [m.content for m in h.messages(1)][-1] == "more"
    finally:
        tmp_path.chmod(0o755)


def test_damaged_pages_fail_that_read_only(tmp_path):
    h = History(damaged_db(tmp_path))
    assert h.warning is None
    assert [c.id for c in h.list_conversations()] == [3, 2, 1]
    with pytest.raises(HistoryError) as e:
        h.messages(2)
    assert "chat 2" in str(e.value) and "corrupt" in str(e.value) and "\n" not in str(e.value)
    assert [m.content for m in h.messages(3)] == ["question 3", "A" * 20]
    cid = h.new_conversation("new")  # the rest of the file still takes writes
    assert h.add_message(cid, "user", "new") is not None and h.warning is None


def test_a_chat_list_that_cannot_be_read_is_never_written_to(tmp_path):
    path = damaged_chat_list(chat_db(tmp_path / "h.db"))
    before = path.read_bytes()
    h = History(path)  # the app's store: the same check as the chats commands, before any write
    assert h.warning and str(path) in h.warning and "corrupt" in h.warning and "will not be saved" in h.warning
    cid = h.new_conversation("typed after")
    assert h.add_message(cid, "user", "typed after") is not None  # the chat goes on, in memory
    assert [m.content for m in h.messages(cid)] == ["typed after"]
    h.close()
    assert path.read_bytes() == before
    assert History(path, read_only=True).warning.startswith(f"could not open the chat history {path}: the file is corrupt")


# -- the command line --------------------------------------------------------------------------
def test_chats_show_on_damaged_pages_is_one_line(tmp_path):
    db = str(damaged_db(tmp_path))
    run = CliRunner().invoke
    r = run(cli_app, ["chats", "show", "2", "--db", db])
    assert r.exit_code == 1 and r.exception is None or isinstance(r.exception, SystemExit)
    assert r.exit_code == 1
    assert r.stderr.startswith("ssd-chat: error: could not read chat 2") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.output
    r = run(cli_app, ["chats", "show", "3", "--db", db])
    assert r.exit_code == 0 and "question 3" in r.stdout
    r = run(cli_app, ["chats", "list", "--db", db])
    assert r.exit_code == 0 and "chat 2" in r.stdout


def test_every_chats_command_calls_an_unreadable_chat_list_corrupt(tmp_path):
    """``list`` fails on it, so ``show``/``export``/``delete`` of a chat in it do too: never "no saved chat"."""
    db = str(damaged_chat_list(chat_db(tmp_path / "h.db")))
    for args in (["list"], ["list", "--json"], ["show", "1"], ["export", "2", "-f", "jsonl"], ["delete", "3"], ["show", "14"]):
        r = CliRunner().invoke(cli_app, ["chats", *args, "--db", db])
        assert r.exit_code == 1, (args, r.output)
        assert r.stderr.startswith(f"ssd-chat: error: could not open the chat history {db}: the file is corrupt"), (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stdout == "", args


def test_chats_delete_that_the_file_refuses_says_so(tmp_path, monkeypatch):
    db = chat_db(tmp_path / "h.db", n=1)
    other = lock(db)
    monkeypatch.setattr(History, "__init__", _short_timeout(History.__init__))
    try:
        r = CliRunner().invoke(cli_app, ["chats", "delete", "1", "--db", str(db)])
    finally:
        release(other)
    assert r.exit_code == 1 and "locked" in r.stderr and "deleted" not in r.stdout
    assert [c.id for c in History(db).list_conversations()] == [1]


def _short_timeout(init):
    def wrapped(self, path=None, *, timeout_s=2.0, **kw):
        init(self, path, timeout_s=0.1, **kw)

    return wrapped


def test_chats_commands_use_the_apps_database_setting(tmp_path, monkeypatch):
    run = CliRunner().invoke
    env_db = chat_db(tmp_path / "env.db", n=1)
    monkeypatch.setenv("SSD_CHAT_DB", str(env_db))
    r = run(cli_app, ["chats", "list"])
    assert r.exit_code == 0 and "chat 1" in r.stdout
    assert run(cli_app, ["chats", "path"]).stdout.strip() == str(env_db)
    monkeypatch.delenv("SSD_CHAT_DB")
    file_db = chat_db(tmp_path / "file.db", n=2)
    cfg = Path(__import__("os").environ["SSD_CHAT_CONFIG_DIR"])
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "config.toml").write_text(f'db = "{file_db}"\n')
    r = run(cli_app, ["chats", "show", "2"])
    assert r.exit_code == 0 and "question 2" in r.stdout
    r = run(cli_app, ["chats", "list", "--db", str(env_db)])  # the flag still wins
    assert r.exit_code == 0 and "chat 2" not in r.stdout


def test_reading_commands_never_create_a_database(tmp_path):
    run = CliRunner().invoke
    db = tmp_path / "new" / "dir" / "h.db"
    r = run(cli_app, ["chats", "list", "--db", str(db)])
    assert r.exit_code == 0 and "no saved chats" in r.stdout and "does not exist" in r.stdout
    for args in (["show", "1"], ["export", "1"], ["delete", "1"]):
        r = run(cli_app, ["chats", *args, "--db", str(db)])
        assert r.exit_code == 1 and "no saved chat with id 1" in r.stderr, args
    assert not (tmp_path / "new").exists()


# -- the app -----------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_the_app_goes_on_when_the_database_is_locked_mid_chat(tmp_path):
    path = tmp_path / "h.db"
    app = ChatApp(FakeBackend([ssd_events(["one"]), ssd_events(["two"]), ssd_events(["three"])]),
                  history=History(path, timeout_s=0.1))
    async with ready(app, size=(120, 40)) as pilot:
        await submit(pilot, app, "first")
        other = lock(path)
        try:
            await submit(pilot, app, "second")
            await submit(pilot, app, "third")
        finally:
            release(other)
        assert replies_text(app) == ["one", "two", "three"]
        assert any("could not write the chat history" in n.text for n in app.query(".notice"))
        assert [m.content for m in app.history.messages(app.chat_view.conversation_id)] == ["first", "one", "second", "two", "third", "three"]
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_the_app_on_an_unreadable_chat_list_says_so_and_chats_without_saving(tmp_path):
    path = damaged_chat_list(chat_db(tmp_path / "h.db"))
    before = path.read_bytes()
    app = ChatApp(FakeBackend([ssd_events(["still here"])]), history=History(path))
    async with ready(app, size=(120, 40)) as pilot:
        notices = [n.text for n in app.query(".notice")]
        assert any(str(path) in n and "corrupt" in n and "will not be saved" in n for n in notices), notices
        await submit(pilot, app, "a new chat")
        assert replies_text(app) == ["still here"]
        assert app.chat_view.messages == [{"role": "user", "content": "a new chat"}, {"role": "assistant", "content": "still here"}]
        await pilot.press("ctrl+c")
    assert app.return_code == 0
    assert path.read_bytes() == before  # nothing written into the damaged file


@pytest.mark.asyncio
async def test_the_app_resumes_a_chat_the_database_will_not_save_to(tmp_path):
    h = History(chat_db(tmp_path / "h.db", n=1))
    h.db.execute("PRAGMA query_only = ON")
    app = ChatApp(FakeBackend([ssd_events(["more"])]), history=h, resume=1)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until(pilot, lambda: app.chat_view.ready and app.chat_view.messages)
        await submit(pilot, app, "go on")
        assert replies_text(app)[-1] == "more"
        assert app.chat_view.messages[-2:] == [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "more"}]
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_the_app_resuming_a_damaged_chat_says_so_and_goes_on(tmp_path):
    h = History(damaged_db(tmp_path))
    app = ChatApp(FakeBackend([ssd_events(["fine"])]), history=h, resume=2)
    async with ready(app, size=(120, 40)) as pilot:
        notices = [n.text for n in app.query(".notice")]
        assert any(n.startswith("cannot resume: could not read chat 2") for n in notices), notices
        assert app.chat_view.conversation_id is None and app.chat_view.messages == []
        await submit(pilot, app, "a new chat")
        assert app.history.warning is None  # the undamaged part of the file still takes the new chat
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.screen.query("#chat-list"))
        assert app.screen.query_one("#chat-list").option_count == 4
        app.screen.query_one("#chat-list").highlighted = 3  # oldest: chat 1, undamaged
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_view.conversation_id == 1)
        await pilot.press("ctrl+c")
    assert app.return_code == 0


def test_a_database_locked_mid_session_in_a_real_terminal(tmp_path):
    """The real app (a recorded session replayed, no model) while another program takes the
    database's write lock after the first reply: the session plays to the end, one warning, exit 0."""
    import time

    pytest.importorskip("pexpect")
    from helpers.history import replay_saving_chats, shipped
    from helpers.pty import App, app_env

    from ssd_chat.chat.recorder import read

    source = next(p for p in shipped() if len(read(p).turns) >= 3)
    turns = len(read(source).turns)
    db = tmp_path / "h.db"
    other = None
    with App([], app_env(tmp_path, SSD_CHAT_DATA_DIR=str(tmp_path / "data"), HF_HUB_OFFLINE="1"), 120,
             command=replay_saving_chats(db, source, 20.0)) as app:
        try:
            def played() -> bool:
                nonlocal other
                text = "".join(app.raw)
                if other is None and text.count("last reply") >= 1:  # the first reply is saved: now lock the file
                    other = lock(db)
                return text.count("last reply") >= turns and text.rfind("last reply") > text.rfind("streaming…")

            app.until(played, 120)  # (or the app is gone: it crashed)
            if app.child.isalive():
                time.sleep(0.5)
                app.quit(30)
                app.raw.append(app.child.before or "")
        finally:
            if other is not None:
                release(other)
    text = "".join(app.raw)
    assert other is not None and "could not write the chat history" in text, text[-3000:]
    assert "Traceback" not in text and "IntegrityError" not in text
    assert text.count("last reply") >= turns and text.rfind("last reply") > text.rfind("streaming…")
    assert app.child.exitstatus == 0, text[-3000:]
