"""The system prompt belongs to the point of the chat where it was set: the replies before it did not
see it.  It is saved as a message there, shown there (in the app, on resume, in ``chats show`` and
exports), sent to the model there, and an older file's chat-wide prompt becomes the chat's first message."""

from __future__ import annotations

import json
import sqlite3

import pytest
from helpers.tui import after_chat, FakeBackend, press_for_reply, ready, ssd_events, wait_until
from typer.testing import CliRunner

from ssd_chat.cli import app as cli_app
from ssd_chat.history.store import History
from ssd_chat.history.schema import MIGRATIONS
from ssd_chat.tui.app import ChatApp
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def sys_(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def transcript(app: ChatApp) -> list[str]:
    """The chat as shown, top to bottom: "user: …", "assistant: …" and the system-prompt notices."""
    out = []
    for w in app.chat_view.chat.children:
        if isinstance(w, UserMessage):
            out.append(f"user: {w.text}")
        elif isinstance(w, AssistantMessage):
            out.append(f"assistant: {w.text}")
        elif "notice" in w.classes and "system prompt" in str(getattr(w, "text", "")):
            out.append(w.text)
    return out


async def chat(app, pilot, *prompts: str) -> None:
    for p in prompts:
        await app.chat_view.submit(p)
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished
                         and not app.chat_view._reply_worker.is_running)


SET_HERE = "system prompt from here on: Answer in French."
AFTER_THREE = ["user: one", "assistant: r1", "user: two", "assistant: r2", "user: three", "assistant: r3", SET_HERE,
               "user: four", "assistant: r4"]


@pytest.mark.asyncio
async def test_a_system_prompt_set_after_three_exchanges_stays_where_it_was_set(tmp_path):
    db = tmp_path / "h.db"
    backend = FakeBackend([ssd_events([f"r{i}"]) for i in range(1, 5)])
    app = ChatApp(backend, history=History(db))
    async with ready(app, size=(140, 45)) as pilot:
        await chat(app, pilot, "one", "two", "three")
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.screen.query("#system-text"))
        app.screen.query_one("#system-text").text = "Answer in French."
        await pilot.press("ctrl+s")
        await wait_until(pilot, lambda: app.chat_view.system == "Answer in French.")
        await chat(app, pilot, "four")
        earlier = [u("one"), a("r1"), u("two"), a("r2"), u("three"), a("r3")]
        assert backend.calls[2] == [u("one"), a("r1"), u("two"), a("r2"), u("three")]
        assert backend.calls[3] == earlier + [sys_("Answer in French."), u("four")]  # not on top of the replies before it
        assert transcript(app) == AFTER_THREE
        cid = app.chat_view.conversation_id
        await pilot.press("ctrl+c")
    h = History(db)
    assert [(m.role, m.content) for m in h.messages(cid)][6] == ("system", "Answer in French.")
    assert h.list_conversations()[0].num_messages == 8  # the system prompt is not counted as a message
    h.close()

    r = CliRunner().invoke(cli_app, ["chats", "show", str(cid), "--db", str(db)])
    assert r.exit_code == 0
    md = r.stdout
    assert md.index("r3") < md.index("**System prompt:** Answer in French.") < md.index("four")
    r = CliRunner().invoke(cli_app, ["chats", "export", str(cid), "-f", "jsonl", "--db", str(db)])
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert "system" not in rows[0] and [x["role"] for x in rows[1:]] == ["user", "assistant"] * 3 + ["system"] + ["user", "assistant"]

    backend = FakeBackend([ssd_events(["r5"])])
    app = ChatApp(backend, history=History(db), resume=cid)  # --resume rebuilds it as it was
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_until(pilot, lambda: app.chat_view.ready and app.chat_view.messages)
        assert transcript(app) == AFTER_THREE
        assert app.chat_view.system == "Answer in French."
        await chat(app, pilot, "five")
        assert backend.calls[0] == earlier + [sys_("Answer in French."), u("four"), a("r4"), u("five")]
        await pilot.press("ctrl+c")


@pytest.mark.asyncio
async def test_clearing_or_replacing_the_system_prompt_applies_from_there_on(tmp_path):
    backend = FakeBackend([ssd_events(["r1"]), ssd_events(["r2"]), ssd_events(["r3"])])
    app = ChatApp(backend, history=History(tmp_path / "h.db"), settings={"system": "be brief"})
    async with ready(app, size=(140, 45)) as pilot:
        await app.chat_view.submit("/system")  # before the first prompt: the chat's start changes, no turns pile up
        await app.chat_view.submit("/system be brief")
        assert app.chat_view.messages == [sys_("be brief")]
        await chat(app, pilot, "one")
        await app.chat_view.submit("/system be long")
        await chat(app, pilot, "two")
        await app.chat_view.submit("/system")
        assert app.chat_view.system is None
        await chat(app, pilot, "three")
        assert backend.calls[0] == [sys_("be brief"), u("one")]
        assert backend.calls[1] == [u("one"), a("r1"), sys_("be long"), u("two")]  # the later prompt replaces the first
        assert backend.calls[2] == [u("one"), a("r1"), u("two"), a("r2"), u("three")]
        cid = app.chat_view.conversation_id
        await pilot.press("ctrl+c")
    md = History(tmp_path / "h.db").export(cid, "md")
    at = [md.index(x) for x in ("**System prompt:** be brief", "\none\n", "**System prompt:** be long", "\ntwo\n", "\nr2\n",
                                "**System prompt cleared**", "\nthree\n")]
    assert at == sorted(at)


def v3_file(path) -> None:
    """A history written by the schema before system prompts were messages (user_version 3)."""
    db = sqlite3.connect(path)
    for step in MIGRATIONS[:3]:
        step(db)
    db.execute("PRAGMA user_version = 3")
    db.execute("INSERT INTO conversations(id, title, system, created_at, updated_at) VALUES (1, 'old', 'old system', 1, 2)")
    db.execute("INSERT INTO conversations(id, title, system, created_at, updated_at) VALUES (2, 'plain', NULL, 1, 3)")
    for cid, role, text in ((1, "user", "hi"), (1, "assistant", "hello"), (2, "user", "yo"), (1, "user", "again"), (1, "assistant", "sure")):
        db.execute("INSERT INTO messages(conversation_id, role, content, created_at) VALUES (?,?,?,1)", (cid, role, text))
    db.commit()
    db.close()


@pytest.mark.asyncio
async def test_an_older_files_chat_wide_system_prompt_becomes_the_first_message(tmp_path):
    db = tmp_path / "h.db"
    v3_file(db)
    r = CliRunner().invoke(cli_app, ["chats", "show", "1", "--db", str(db)])  # read-only: migrated in memory
    assert r.exit_code == 0 and r.stdout.index("**System prompt:** old system") < r.stdout.index("## You")
    assert sqlite3.connect(db).execute("PRAGMA user_version").fetchone()[0] == 3  # the file itself untouched
    h = History(db)
    assert h.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert [(m.role, m.content) for m in h.messages(1)] == [("system", "old system"), ("user", "hi"), ("assistant", "hello"),
                                                             ("user", "again"), ("assistant", "sure")]
    assert [(m.role, m.content) for m in h.messages(2)] == [("user", "yo")]
    assert {c.id: c.num_messages for c in h.list_conversations()} == {1: 4, 2: 1}
    h.close()
    backend = FakeBackend([ssd_events(["more"])])
    app = ChatApp(backend, history=History(db), resume=1)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_until(pilot, lambda: app.chat_view.ready and app.chat_view.messages)
        assert transcript(app)[0] == "system prompt from here on: old system"
        await chat(app, pilot, "go on")
        assert backend.calls[0] == [sys_("old system"), u("hi"), a("hello"), u("again"), a("sure"), u("go on")]
        await pilot.press("ctrl+c")
    h = History(db)
    assert [m.content for m in h.messages(1)][-2:] == ["go on", "more"]  # new ids follow the old ones
    h.close()


@pytest.mark.asyncio
async def test_f5_after_a_new_system_prompt_regenerates_the_reply_with_it(tmp_path):
    async with after_chat(tmp_path / "h.db", ("r1", "r2", "r1 again"), ("one", "two"), size=(140, 45)) as (app, backend, pilot):
        await app.chat_view.submit("/system Answer in French.")
        await press_for_reply(pilot, app, "f5", 3)
        assert backend.calls[2] == [u("one"), a("r1"), sys_("Answer in French."), u("two")]
        assert transcript(app) == ["user: one", "assistant: r1", "system prompt from here on: Answer in French.",
                                   "user: two", "assistant: r1 again"]
        cid = app.chat_view.conversation_id
        await pilot.press("ctrl+c")
    h = History(tmp_path / "h.db")
    assert [(m.role, m.content) for m in h.messages(cid)] == [("user", "one"), ("assistant", "r1"), ("system", "Answer in French."),
                                                               ("user", "two"), ("assistant", "r1 again")]
    h.close()
