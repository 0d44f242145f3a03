"""Text the user (or a model, or a file name) wrote is shown as plain text everywhere in the app:
Textual markup in it is neither obeyed nor allowed to crash a render."""

from __future__ import annotations


import pytest

from helpers.tui import FakeBackend, plain, ready, ssd_events, wait_until

from ssd_chat.history.store import History  # noqa: E402
from ssd_chat.tui.app import ChatApp  # noqa: E402

# each of these is bad markup ([/] closes nothing) or markup that would act ([link], [@click])
HOSTILE = ["[/]", "a [link=https://example.com]link[/link]", "[bold red]loud", "[@click=app.quit]quit[/]"]


def shown(widget) -> str:
    """What a Static, Label or Toast displays, as plain text (after any markup was applied)."""
    from textual.content import Content

    visual = widget.render()
    return visual.plain if isinstance(visual, Content) else str(visual)


@pytest.mark.asyncio
async def test_hostile_chat_titles_in_the_chats_dialog_and_on_resume(tmp_path):
    h = History(tmp_path / "h.db")
    for text in HOSTILE:
        cid = h.new_conversation(text)
        h.add_message(cid, "user", text)
        h.add_message(cid, "assistant", "ok")
    app = ChatApp(FakeBackend([ssd_events(["fine"])]), history=h)
    async with ready(app, size=(140, 40)) as pilot:
        for _ in range(2):  # the list is drawn again on every Ctrl+R
            await pilot.press("ctrl+r")
            await wait_until(pilot, lambda: app.screen.query("#chat-list"))
            ol = app.screen.query_one("#chat-list")
            await pilot.pause()
            prompts = [str(ol.get_option_at_index(i).prompt) for i in range(ol.option_count)]
            for text in HOSTILE:
                assert any(text in p for p in prompts), (text, prompts)
            await pilot.press("escape")
            await wait_until(pilot, lambda: not app.screen.query("#chat-list"))
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.screen.query("#chat-list"))
        app.screen.query_one("#chat-list").highlighted = 0  # newest first: the last hostile title
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_view.messages)
        assert app.chat_view.messages[0]["content"] == HOSTILE[-1]
        notices = [shown(n) for n in app.query(".notice")]
        assert any(f"resumed chat {app.chat_view.conversation_id}: {HOSTILE[-1]}" in n for n in notices), notices
        await app.chat_view.submit("and now?")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_hostile_model_names_load_errors_and_paths(tmp_path):
    class Failing(FakeBackend):
        def load(self, progress):
            progress(f"loading {HOSTILE[0]}", None)
            raise ValueError(f"no model at /models/{HOSTILE[1]}")

    backend = Failing([])
    backend.info_.update(target=HOSTILE[0], draft=HOSTILE[2], target_device=HOSTILE[3])
    blocker = tmp_path / "x[" / "][bold]file"  # the path reads .../x[/][bold]file
    blocker.parent.mkdir()
    blocker.write_text("")  # a file where the database's folder would be: the history warns, quoting the path
    app = ChatApp(backend, history=History(blocker / "h.db"))
    async with app.run_test(size=(140, 40), notifications=True) as pilot:
        await wait_until(pilot, lambda: app.chat_view.load_error is not None)
        await pilot.pause()
        assert f"/models/{HOSTILE[1]}" in shown(app.query_one("#load-stage"))
        await wait_until(pilot, lambda: app.screen.query("Toast"))
        toasts = [shown(t) for t in app.screen.query("Toast")]
        assert any("x[/][bold]file" in t for t in toasts), toasts
        app.chat_view.panel.set_info(backend.info())
        await pilot.pause()
        setup = plain(app.chat_view.panel.query_one("#setup"))
        for text in (HOSTILE[0], HOSTILE[2], HOSTILE[3]):
            assert text in setup, setup
        app.notify(f"exported to /tmp/{HOSTILE[1]}")
        await pilot.pause()
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_hostile_text_in_the_settings_dialog_error():
    backend = FakeBackend([])
    app = ChatApp(backend)
    async with ready(app, size=(140, 40)) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        from textual.widgets import Input

        app.screen.query_one("#temperature", Input).value = HOSTILE[0]
        await pilot.click("#apply")
        await pilot.pause()
        assert f"got '{HOSTILE[0]}'" in shown(app.screen.query_one("#settings-error"))
        await pilot.press("escape")
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_token_colours_render_the_markdown_and_keep_hostile_text_literal():
    """Ctrl+T: ``**`` and list markers are rendered, not shown; each character keeps its token's colour;
    Textual markup and escape sequences in the reply are shown as written."""
    from rich.style import Style

    from ssd_chat.tui.widgets.chat_log import AssistantMessage

    words = ["Say", " **Bold**", " and", " [red]x[/red]", " \x1b]0;X\x07", " [@click=app.quit]q[/]", "\n\n- item"]
    app = ChatApp(FakeBackend([ssd_events(words)]))
    async with ready(app, size=(140, 40)) as pilot:
        await app.chat_view.submit("q")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        await pilot.press("ctrl+t")
        await pilot.pause()
        msg = app.query_one(AssistantMessage)
        view = shown(msg._colour_view)
        assert "**" not in view and view.startswith("Say Bold and [red]x[/red] \\x1b]0;X\\x07 [@click=app.quit]q[/]"), view
        assert "• item" in view and "- item" not in view, view
        assert app.is_running
        text = msg._coloured()

        def style_at(i: int) -> Style:
            return Style.combine([s.style for s in text.spans if s.start <= i < s.end])

        # round 1 accepted the draft's " **Bold**" (green, and bold from the Markdown); the target's " and" follows;
        # round 2 accepted the draft's " [red]x[/red]" (green, not bold)
        bold, after, red = (style_at(text.plain.index(w)) for w in ("Bold", "and", "[red]"))
        assert bold.bold and bold.color.name == "green", bold
        assert after.color.name == "yellow", after
        assert red.color.name == "green" and not red.bold, red
        assert style_at(text.plain.index("•")).color.name == "yellow"  # the list marker in its token's colour
        await pilot.press("ctrl+c")
    assert app.return_code == 0
