"""Conversation branches in the store: the schema-5 migration of a database written by the release
before it, branch creation, switching, the current path and exports.

tests/data/history_v4.db was written by that release's own History: a chat with a system prompt, a
mid-chat one, metrics and a stopped reply, cut by its edit (truncate) after copy_conversation saved it
as "… (before edit)"; and a plain chat."""

from __future__ import annotations

import json
import shutil
import sqlite3

from typer.testing import CliRunner

from ssd_chat.cli import app as cli
from ssd_chat.history.store import History
from ssd_chat.history.schema import MIGRATIONS
from pathlib import Path

V4 = Path(__file__).parent / "data" / "history_v4.db"


def texts(h: History, cid: int, **kw) -> list[tuple[str, str]]:
    return [(m.role, m.content) for m in h.messages(cid, **kw)]


def test_the_v4_fixture_is_schema_4():
    db = sqlite3.connect(f"file:{V4}?mode=ro&immutable=1", uri=True)  # no -wal/-shm beside the fixture
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 4
        assert "parent_id" not in [r[1] for r in db.execute("PRAGMA table_info(messages)")]
    finally:
        db.close()


def test_migration_keeps_every_chat_message_and_metric(tmp_path):
    path = tmp_path / "h.db"
    shutil.copy(V4, path)
    old = sqlite3.connect(path)
    before = old.execute("SELECT id, conversation_id, role, content, status, created_at FROM messages ORDER BY id").fetchall()
    metrics = old.execute("SELECT * FROM turn_metrics ORDER BY message_id").fetchall()
    chats = old.execute("SELECT id, title, created_at, updated_at FROM conversations ORDER BY id").fetchall()
    old.close()
    h = History(path)
    assert h.warning is None
    assert h.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) == 5
    assert h.db.execute("SELECT id, conversation_id, role, content, status, created_at FROM messages ORDER BY id").fetchall() == before
    assert h.db.execute("SELECT * FROM turn_metrics ORDER BY message_id").fetchall() == metrics
    assert h.db.execute("SELECT id, title, created_at, updated_at FROM conversations ORDER BY id").fetchall() == chats
    # each chat is one branch: its messages in the order they were saved, none with siblings
    for cid, title, *_ in chats:
        want = [(r[2], r[3]) for r in before if r[1] == cid]
        assert texts(h, cid) == want and h.branches(cid) == {}
    assert [c.title for c in sorted(h.list_conversations(), key=lambda c: c.id)] == [
        "capital", "What is the capital of France? (before edit)", "second chat"]  # the old copy stays a chat
    assert texts(h, 1) == [("system", "Be brief."), ("user", "What is the capital of France?"), ("assistant", "Paris."),
                           ("system", "Answer in French."), ("user", "And of Spain?"), ("assistant", "Madrid.")]
    assert h.messages(1)[2].metrics["tok_per_s"] == 12.5
    # and it goes on: a new message follows the last one
    h.add_message(3, "user", "more")
    assert texts(h, 3)[-2:] == [("assistant", "hi"), ("user", "more")]
    h.close()


def test_reading_a_v4_file_read_only_shows_it_without_changing_it(tmp_path):
    path = tmp_path / "h.db"
    shutil.copy(V4, path)
    data = path.read_bytes()
    h = History(path, read_only=True)
    assert h.warning is None and texts(h, 3) == [("user", "hello"), ("assistant", "hi")]
    h.close()
    assert path.read_bytes() == data


def chat(h: History) -> tuple[int, list[int]]:
    cid = h.new_conversation("q")
    ids = [h.add_message(cid, "user", "q1"), h.add_message(cid, "assistant", "a1"),
           h.add_message(cid, "user", "q2"), h.add_message(cid, "assistant", "a2")]
    return cid, ids


def test_regenerate_adds_a_sibling_reply_and_switching_moves_the_current_branch(tmp_path):
    h = History(tmp_path / "h.db")
    cid, (u1, a1, u2, a2) = chat(h)
    a2b = h.add_message(cid, "assistant", "a2 again", parent=u2)
    assert texts(h, cid) == [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2 again")]
    assert h.branches(cid) == {a2: (1, 2), a2b: (2, 2)}
    assert h.switch(cid, a2b, +1) is None  # past the end: nothing changes
    assert h.switch(cid, a2b, -1) == a2
    assert texts(h, cid)[-1] == ("assistant", "a2")
    h.add_message(cid, "user", "q3")  # the next message follows the branch in view
    assert texts(h, cid)[-2:] == [("assistant", "a2"), ("user", "q3")]
    h.close()
    h = History(tmp_path / "h.db")  # the choice is saved
    assert texts(h, cid)[-2:] == [("assistant", "a2"), ("user", "q3")]
    assert h.switch(cid, a2, +1) == a2b and texts(h, cid)[-1] == ("assistant", "a2 again")
    assert len(h.messages(cid, all_branches=True)) == 6
    h.close()


def test_an_edit_adds_a_sibling_user_message_and_each_branch_keeps_its_own_choice_below(tmp_path):
    h = History(tmp_path / "h.db")
    cid, (u1, a1, u2, a2) = chat(h)
    a2b = h.add_message(cid, "assistant", "a2 again", parent=u2)
    e1 = h.add_message(cid, "user", "q1 edited", parent=h.parent_of(u1))
    ea = h.add_message(cid, "assistant", "new a1")
    assert texts(h, cid) == [("user", "q1 edited"), ("assistant", "new a1")]
    assert h.branches(cid) == {u1: (1, 2), e1: (2, 2), a2: (1, 2), a2b: (2, 2)}
    assert h.switch(cid, e1, -1) == u1  # back to the first branch: as it was left, with the regenerated reply
    assert texts(h, cid) == [("user", "q1"), ("assistant", "a1"), ("user", "q2"), ("assistant", "a2 again")]
    assert h.switch(cid, u1, +1) == e1 and h.messages(cid)[-1].id == ea
    h.close()


def test_a_branch_that_starts_with_a_system_prompt_is_a_sibling_of_the_message_it_replaces(tmp_path):
    """Regenerating a reply after which a system prompt was set re-applies it before the question: the branch
    starts with that prompt, and the question in it is the old question's sibling."""
    h = History(tmp_path / "h.db")
    cid, (u1, a1, u2, a2) = chat(h)
    h.set_system(cid, "be brief")
    s = h.add_message(cid, "system", "be brief", parent=a1)
    u2b = h.add_message(cid, "user", "q2", parent=s)
    a2b = h.add_message(cid, "assistant", "short")
    assert texts(h, cid)[2:] == [("system", "be brief"), ("user", "q2"), ("assistant", "short")]
    assert h.branches(cid) == {u2: (1, 2), u2b: (2, 2)}
    assert h.switch(cid, u2b, -1) == u2
    assert texts(h, cid)[2:] == [("user", "q2"), ("assistant", "a2"), ("system", "be brief")]
    assert h.switch(cid, u2, +1) == u2b and h.messages(cid)[-1].id == a2b
    h.close()


def branched_db(tmp_path) -> tuple[Path, int]:
    path = tmp_path / "h.db"
    h = History(path)
    cid, (u1, a1, u2, a2) = chat(h)
    h.add_message(cid, "assistant", "a2 again", parent=u2)
    h.close()
    return path, cid


def test_export_writes_the_current_branch_and_all_branches_writes_the_tree(tmp_path):
    path, cid = branched_db(tmp_path)
    h = History(path)
    md = h.export(cid, "md")
    assert "a2 again" in md and "\na2\n" not in md and "#" + "4" not in md
    tree = h.export(cid, "md", all_branches=True)
    assert "\na2\n" in tree and "a2 again" in tree
    assert "## Assistant [#4 after #3]" in tree and "## Assistant [#5 after #3, current branch]" in tree
    rows = [json.loads(line) for line in h.export(cid, "jsonl", all_branches=True).splitlines()[1:]]
    assert [(r["id"], r["parent_id"], r["current"], r["content"]) for r in rows] == [
        (1, None, True, "q1"), (2, 1, True, "a1"), (3, 2, True, "q2"), (4, 3, False, "a2"), (5, 3, True, "a2 again")]
    doc = json.loads(h.export(cid, "json"))
    assert [m["content"] for m in doc["messages"]] == ["q1", "a1", "q2", "a2 again"] and "id" not in doc["messages"][0]
    h.close()


def test_chats_show_and_export_all_branches(tmp_path):
    path, cid = branched_db(tmp_path)
    r = CliRunner().invoke(cli, ["chats", "show", str(cid), "--db", str(path)])
    assert r.exit_code == 0, r.output
    assert "a2 again" in r.output and "\na2\n" not in r.output
    r = CliRunner().invoke(cli, ["chats", "show", str(cid), "--all-branches", "--db", str(path)])
    assert r.exit_code == 0 and "\na2\n" in r.output and "[#5 after #3, current branch]" in r.output
    r = CliRunner().invoke(cli, ["chats", "export", str(cid), "-f", "jsonl", "--all-branches", "--db", str(path)])
    assert r.exit_code == 0, r.output
    assert sum('"current": false' in line for line in r.output.splitlines()) == 1
