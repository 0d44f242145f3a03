"""Chat history: migrations, save/resume/delete/export, and a damaged database never stopping the chat."""

from __future__ import annotations

import json
import sqlite3

from ssd_chat.engine.events import Stats
from ssd_chat.history.store import History, data_dir, default_db_path
from ssd_chat.history.schema import MIGRATIONS, migrate


def stats(**kw) -> Stats:
    base = dict(mode="ssd", new_tokens=10, rounds=4, elapsed_s=1.0, prefill_s=0.1, ttft_s=0.2, tok_per_s=12.5,
                acceptance_rate=0.5, mean_accepted_length=2.5, cache_hit_rate=0.75)
    base.update(kw)
    return Stats(**base)


def test_location_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_DATA_DIR", str(tmp_path / "d"))
    assert default_db_path() == tmp_path / "d" / "history.db"
    monkeypatch.delenv("SSD_CHAT_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "x"))
    assert data_dir() == tmp_path / "x" / "ssd-chat"


def test_migrations_run_once_in_order_and_upgrade_an_old_db(tmp_path):
    path = tmp_path / "h.db"
    db = sqlite3.connect(path)
    MIGRATIONS[0](db)  # a database from the first version
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations(title, system, created_at, updated_at) VALUES ('old', NULL, 1, 1)")
    db.execute("INSERT INTO messages(conversation_id, role, content, created_at) VALUES (1, 'user', 'hi', 1)")
    db.commit()
    db.close()
    h = History(path)
    assert h.warning is None
    assert h.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert [(m.role, m.content, m.status) for m in h.messages(1)] == [("user", "hi", "done")]
    assert migrate(h.db) == len(MIGRATIONS)  # idempotent
    h.close()


def test_save_resume_metrics_delete(tmp_path):
    h = History(tmp_path / "h.db")
    cid = h.new_conversation("", "be nice")
    h.add_message(cid, "user", "What is  a\nhash table?")
    mid = h.add_message(cid, "assistant", "", status="streaming")
    h.update_message(mid, "A map", "streaming")
    h.update_message(mid, "A map from keys", "stopped")
    h.save_metrics(mid, stats(), "smollm2", "int8")
    h.close()
    h = History(tmp_path / "h.db")
    [conv] = h.list_conversations()
    assert conv.title == "What is a hash table?" and conv.num_messages == 2  # the system prompt is not counted
    system, *msgs = h.messages(cid)
    assert (system.role, system.content) == ("system", "be nice")
    assert msgs[1].content == "A map from keys" and msgs[1].status == "stopped"
    assert msgs[1].metrics["mean_accepted_length"] == 2.5 and msgs[1].metrics["target"] == "smollm2"
    assert h.delete_conversation(cid) and not h.delete_conversation(cid)
    assert h.list_conversations() == []
    assert h.db.execute("SELECT count(*) FROM messages").fetchone()[0] == 0  # cascaded


def test_export_markdown_and_jsonl(tmp_path):
    h = History(tmp_path / "h.db")
    cid = h.new_conversation("q", "sys")
    h.add_message(cid, "user", "q")
    mid = h.add_message(cid, "assistant", "**answer**")
    h.save_metrics(mid, stats())
    md = h.export(cid, "md")
    assert "## You" in md and "**answer**" in md and md.index("**System prompt:** sys") < md.index("## You")
    assert "τ 2.50" in md and "cache hits 75%" in md
    rows = [json.loads(line) for line in h.export(cid, "jsonl").splitlines()]
    assert rows[0]["type"] == "conversation" and rows[1]["role"] == "system" and rows[3]["metrics"]["cache_hit_rate"] == 0.75
    try:
        h.export(999, "md")
    except KeyError as e:
        assert "999" in str(e)
    else:
        raise AssertionError("expected KeyError")


def test_corrupt_file_gives_warning_and_memory_store(tmp_path):
    bad = tmp_path / "h.db"
    bad.write_bytes(b"garbage" * 1000)
    h = History(bad)
    assert h.warning and "corrupt" in h.warning and "in memory" in h.warning and str(bad) in h.warning
    cid = h.new_conversation("x")
    h.add_message(cid, "user", "still works")
    assert h.messages(cid)[0].content == "still works"
    assert bad.read_bytes() == b"garbage" * 1000


def test_locked_db_gives_warning(tmp_path):
    path = tmp_path / "h.db"
    History(path).close()
    other = sqlite3.connect(path)
    other.execute("PRAGMA locking_mode = EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    h = History(path, timeout_s=0.1)
    assert h.warning and "locked" in h.warning
    assert h.new_conversation("works in memory") is not None
    other.rollback()
    other.close()


def test_write_failure_later_degrades_to_memory(tmp_path):
    path = tmp_path / "h.db"
    h = History(path)
    cid = h.new_conversation("a")
    h.db.execute("DROP TABLE messages")  # simulate a damaged file under our feet
    assert h.add_message(cid, "user", "x") is None
    assert h.warning and "could not write" in h.warning
    cid2 = h.new_conversation("b")
    assert h.add_message(cid2, "user", "kept") is not None


def test_unwritable_location(tmp_path):
    (tmp_path / "file").write_text("")
    h = History(tmp_path / "file" / "h.db")  # parent is a file
    assert h.warning and "in memory" in h.warning


def test_chats_commands_list_export_delete(tmp_path):
    from typer.testing import CliRunner

    from ssd_chat.cli import app

    db = tmp_path / "h.db"
    h = History(db)
    cid = h.new_conversation("first chat")
    h.add_message(cid, "user", "first chat")
    mid = h.add_message(cid, "assistant", "an answer")
    h.save_metrics(mid, stats())
    h.add_message(h.new_conversation("second"), "user", "second")
    h.close()
    run = CliRunner().invoke
    r = run(app, ["chats", "list", "--db", str(db)])
    assert r.exit_code == 0 and "first chat" in r.stdout and f"{cid}" in r.stdout
    assert "2 messages  first chat" in r.stdout and "1 message  second" in r.stdout
    r = run(app, ["--db", str(db), "chats", "export", str(cid)])  # --db before the subcommand works too
    assert r.exit_code == 0 and "an answer" in r.stdout and "## Assistant" in r.stdout
    out = tmp_path / "c.jsonl"
    r = run(app, ["chats", "export", str(cid), "-f", "jsonl", "-o", str(out), "--db", str(db)])
    assert r.exit_code == 0 and json.loads(out.read_text().splitlines()[2])["content"] == "an answer"
    r = run(app, ["chats", "export", "77", "--db", str(db)])
    assert r.exit_code == 1 and "no saved chat with id 77" in r.stderr
    r = run(app, ["chats", "export", str(cid), "-f", "pdf", "--db", str(db)])
    assert r.exit_code == 2
    r = run(app, ["chats", "delete", str(cid), "--db", str(db)])
    assert r.exit_code == 0 and [c.title for c in History(db).list_conversations()] == ["second"]
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"nope" * 100)
    r = run(app, ["chats", "list", "--db", str(bad)])
    assert r.exit_code == 1 and "corrupt" in r.stderr and "Traceback" not in r.output


def test_demo_prompts_are_packaged():
    from ssd_chat.chat.demo import demo_prompts

    prompts = demo_prompts()
    assert len(prompts) >= 3 and any(p.startswith("/mode") for p in prompts)
    assert all(p.strip() == p and p for p in prompts)


def test_chats_export_takes_the_format_from_the_file_name_or_refuses_a_mismatch(tmp_path):
    from typer.testing import CliRunner

    from ssd_chat.cli import app

    db = tmp_path / "h.db"
    h = History(db)
    cid = h.new_conversation("q")
    h.add_message(cid, "user", "q")
    h.save_metrics(h.add_message(cid, "assistant", "an answer"), stats())
    h.close()
    run = CliRunner().invoke
    out = tmp_path / "x.json"
    r = run(app, ["chats", "export", str(cid), "-o", str(out), "--db", str(db)])
    assert r.exit_code == 0
    doc = json.loads(out.read_text())  # one JSON document, not Markdown or JSON Lines
    assert doc["id"] == cid and [m["content"] for m in doc["messages"]] == ["q", "an answer"]
    assert doc["messages"][1]["metrics"]["cache_hit_rate"] == 0.75
    r = run(app, ["chats", "export", str(cid), "-o", str(tmp_path / "x.jsonl"), "--db", str(db)])
    assert r.exit_code == 0 and json.loads((tmp_path / "x.jsonl").read_text().splitlines()[0])["type"] == "conversation"
    r = run(app, ["chats", "export", str(cid), "-o", str(tmp_path / "x.md"), "--db", str(db)])
    assert r.exit_code == 0 and (tmp_path / "x.md").read_text().startswith("# q")
    mismatch = tmp_path / "y.json"
    r = run(app, ["chats", "export", str(cid), "-f", "md", "-o", str(mismatch), "--db", str(db)])
    assert r.exit_code == 1 and not mismatch.exists()
    assert r.stderr.startswith("ssd-chat: error: --format md writes Markdown") and r.stderr.count("\n") == 1
    r = run(app, ["chats", "export", str(cid), "-f", "json", "--db", str(db)])  # stdout: the format asked for
    assert r.exit_code == 0 and json.loads(r.stdout)["title"] == "q"
