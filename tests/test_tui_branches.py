"""Pilot tests: branches in the app.  F5 and edits leave the old reply / message as a sibling, ←/→ on a
message focused with Shift+Tab switch between siblings ("‹ 1/2 ›"), the chat below follows, the next
reply's context is the branch on screen, and --resume opens it (scripted streams, no model)."""

from __future__ import annotations

import contextlib

import pytest
from helpers.tui import after_chat, chat, FakeBackend, laid_out, on_screen, press_for_reply, ready, scripted_app, ssd_events, wait_until

from ssd_chat.history.store import History
from ssd_chat.tui.app import ChatApp
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage


async def focus_back_to(app: ChatApp, pilot, kind: type, text: str) -> None:
    """Shift+Tab from the prompt box until the message ``text`` of ``kind`` has the focus."""
    app.chat_view.prompt.focus()
    await wait_until(pilot, lambda: app.focused is app.chat_view.prompt and laid_out(app))
    for _ in range(12):
        await pilot.press("shift+tab")
        await pilot.pause()
        if isinstance(app.focused, kind) and app.focused.text == text:
            return
    raise AssertionError(f"could not focus {text!r}")


def blocking_backend() -> FakeBackend:
    """A backend whose first reply stops halfway until released (``blocked`` is set meanwhile)."""
    return FakeBackend([ssd_events(["one"]), ssd_events(["long", " reply", " here", " and", " more"])], block=True)


@contextlib.asynccontextmanager
async def streaming_a(tmp_path):
    """The app (a history in ``tmp_path``) once loaded, with "a" sent and its reply held halfway: (app, pilot, backend)."""
    backend = blocking_backend()
    app = ChatApp(backend, history=History(tmp_path / "h.db"))
    async with ready(app, size=(140, 45)) as pilot:
        await app.chat_view.submit("a")
        await wait_until(pilot, lambda: backend.blocked.is_set())
        yield app, pilot, backend


def labels(app: ChatApp) -> list[tuple[str, str]]:
    return [(w.text, w.branch) for w in app.chat_view.chat.query("UserMessage, AssistantMessage")]


@pytest.mark.asyncio
async def test_regenerate_leaves_two_replies_and_left_right_switch_between_them(tmp_path):
    async with after_chat(tmp_path / "h.db", ("one", "again", "next"), ("a",), size=(140, 45)) as (app, backend, pilot):
        await press_for_reply(pilot, app, "f5", 2)
        assert labels(app) == [("a", ""), ("again", "‹ 2/2 ›")]
        await focus_back_to(app, pilot, AssistantMessage, "again")
        assert "2/2" in str(app.focused.query_one(".branch").render())  # shown on screen, above the reply
        await pilot.press("left")
        await wait_until(pilot, lambda: on_screen(app) == [("user", "a"), ("assistant", "one")])
        assert labels(app) == [("a", ""), ("one", "‹ 1/2 ›")]
        assert isinstance(app.focused, AssistantMessage) and app.focused.text == "one"  # the focus stays on it
        await pilot.press("left")  # no branch before the first: nothing changes
        await pilot.pause()
        assert labels(app) == [("a", ""), ("one", "‹ 1/2 ›")]
        await pilot.press("right")
        await wait_until(pilot, lambda: labels(app) == [("a", ""), ("again", "‹ 2/2 ›")])
        await pilot.press("left")
        await wait_until(pilot, lambda: labels(app) == [("a", ""), ("one", "‹ 1/2 ›")])
        # the next reply's context is the branch on screen
        await chat(app, pilot, "b")
        assert backend.calls[2] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                                    {"role": "user", "content": "b"}]
        cid = app.chat_view.conversation_id
    h = History(tmp_path / "h.db")
    assert [m.content for m in h.messages(cid)] == ["a", "one", "b", "next"]
    assert [m.content for m in h.messages(cid, all_branches=True)] == ["a", "one", "again", "b", "next"]
    h.close()


@pytest.mark.asyncio
async def test_switching_an_edited_message_brings_the_chat_below_it_and_resume_opens_the_current_branch(tmp_path):
    async with after_chat(tmp_path / "h.db", ("one", "two", "new one"), ("first", "second"), size=(140, 45)) as (app, backend, pilot):
        await app.chat_view.submit("/edit 1")
        app.chat_view.prompt.set_text("first, edited")
        await press_for_reply(pilot, app, "enter", 3)
        assert labels(app) == [("first, edited", "‹ 2/2 ›"), ("new one", "")]
        await focus_back_to(app, pilot, UserMessage, "first, edited")
        assert "‹ 2/2 › first, edited" in str(app.focused.render())
        await pilot.press("left")  # the whole chat below follows the first message's branch
        await wait_until(pilot, lambda: on_screen(app) == [("user", "first"), ("assistant", "one"), ("user", "second"),
                                                           ("assistant", "two")])
        assert labels(app)[0] == ("first", "‹ 1/2 ›")
        assert app.history.get_conversation(app.chat_view.conversation_id).title == "first"  # the first prompt names it
        assert app.chat_view.messages == [{"role": r, "content": c} for r, c in on_screen(app)]
        cid = app.chat_view.conversation_id
        await pilot.press("ctrl+c")
    app = ChatApp(FakeBackend([]), history=History(tmp_path / "h.db"), resume=cid)
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_until(pilot, lambda: len(on_screen(app)) == 4)
        assert on_screen(app)[0] == ("user", "first") and labels(app)[0] == ("first", "‹ 1/2 ›")


@pytest.mark.asyncio
async def test_left_right_on_a_message_without_siblings_change_nothing(tmp_path):
    async with streaming_a(tmp_path) as (app, pilot, backend):
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_view.current.finished and not app.chat_view._reply_worker.is_running)
        await focus_back_to(app, pilot, UserMessage, "a")
        await pilot.press("right")
        await pilot.pause()
        assert len(on_screen(app)) == 2 and labels(app)[0] == ("a", "")


@pytest.mark.asyncio
async def test_one_focused_reply_takes_left_right_and_c_and_f5_leaves_staged_files_for_the_next_message(tmp_path):
    """Branches and files in a prompt share the focus: ←/→ and c act on the same focused reply; F5 re-sends
    the saved question without the files staged meanwhile, which go with the next message."""
    src = tmp_path / "x.py"
    src.write_text("x = 1\n")
    blocky = ["```python\nold = 1\n```\n"]
    backend = FakeBackend([ssd_events(blocky), ssd_events(["```bash\nnew\n```\n"]), ssd_events(["ok"])])
    app = ChatApp(backend, history=History(tmp_path / "h.db"))
    async with ready(app, size=(140, 45)) as pilot:
        view = app.chat_view
        out: list[str] = []
        app.notify = lambda message, **kw: out.append(message)
        await chat(app, pilot, "a")
        await view.submit(f"/attach {src}")
        await pilot.press("f5")
        await wait_until(pilot, lambda: len(backend.calls) == 2 and view.current.finished)
        assert backend.calls[1] == [{"role": "user", "content": "a"}]  # the saved question, as it was
        assert [a.shown for a, _ in view.controller.attach.staged] == [str(src)]  # still staged
        await focus_back_to(app, pilot, AssistantMessage, "```bash\nnew\n```\n")
        await pilot.press("c")
        await wait_until(pilot, lambda: out)
        assert view.controller.actions.clipboard_text == "new\n"
        await pilot.press("left")
        await wait_until(pilot, lambda: labels(app) == [("a", ""), (blocky[0], "‹ 1/2 ›")])
        assert isinstance(app.focused, AssistantMessage) and app.focused.text == blocky[0]
        await pilot.press("c")  # the switched-to reply's own block
        await wait_until(pilot, lambda: view.controller.actions.clipboard_text == "old = 1\n")
        await chat(app, pilot, "b")
        assert backend.calls[2][-1]["content"].startswith(f"File: {src}\n") and view.controller.attach.staged == []
        await pilot.press("ctrl+c")


@pytest.mark.asyncio
async def test_the_palette_and_help_list_the_keys_of_a_focused_message(tmp_path):
    from ssd_chat.tui.actions import HELP

    app, backend = scripted_app(tmp_path / "h.db", "```python\ny = 2\n```\n", "two")
    async with ready(app, size=(140, 45)) as pilot:
        view = app.chat_view
        for key in ("←/→", "then c", "then e", "/attach", "/save"):
            assert key in HELP
        commands = {c.title: c for c in app.get_system_commands(app.screen)}
        await chat(app, pilot, "a")
        commands["Copy a code block"].callback()
        await wait_until(pilot, lambda: view.controller.actions.clipboard_text == "y = 2\n")
        await pilot.press("f5")
        await wait_until(pilot, lambda: len(backend.calls) == 2 and view.current.finished)
        commands["Previous branch"].callback()
        await wait_until(pilot, lambda: labels(app) == [("a", ""), ("```python\ny = 2\n```\n", "‹ 1/2 ›")])
        commands["Next branch"].callback()
        await wait_until(pilot, lambda: labels(app) == [("a", ""), ("two", "‹ 2/2 ›")])
        commands["Attach a file"].callback()
        assert view.prompt.text == "/attach "
        await pilot.press("ctrl+c")


@pytest.mark.asyncio
async def test_typing_or_esc_on_a_focused_message_goes_back_to_the_prompt_box(tmp_path):
    """A focused message keeps its own keys (e edits); other text, and Esc, return to the box (they once went
    nowhere: the user's typing was lost)."""
    app, backend = scripted_app(tmp_path / "h.db", "one")
    async with ready(app, size=(140, 45)) as pilot:
        await app.chat_view.submit("a")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        await focus_back_to(app, pilot, AssistantMessage, "one")
        await pilot.press("h", "i")
        await pilot.pause()
        assert app.focused is app.chat_view.prompt and app.chat_view.prompt.text == "hi"
        await focus_back_to(app, pilot, UserMessage, "a")
        await pilot.press("escape")
        await pilot.pause()
        assert app.focused is app.chat_view.prompt and app.chat_view.prompt.text == "hi"
        await focus_back_to(app, pilot, UserMessage, "a")
        await pilot.press("e")  # the message's own key still edits
        await wait_until(pilot, lambda: app.focused is not app.chat_view.prompt or "a" in app.chat_view.prompt.text)


@pytest.mark.asyncio
async def test_esc_on_a_focused_message_still_stops_a_streaming_reply(tmp_path):
    async with streaming_a(tmp_path) as (app, pilot, backend):
        await focus_back_to(app, pilot, UserMessage, "a")
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.chat_view.current.finished)
        assert app.focused is app.chat_view.prompt
