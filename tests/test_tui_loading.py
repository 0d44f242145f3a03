"""Settings while the model loads, and after it failed to load: Ctrl+O, /mode, /k and the palette's mode
switch never crash the app; a change made while loading is remembered and applied once the engine is ready.
And a history warning found at start is said once."""

from __future__ import annotations


import pytest

from helpers.tui import ready, SlowEngineBackend, ssd_events, wait_until

from ssd_chat.tui.app import ChatApp  # noqa: E402
from ssd_chat.tui.widgets.settings_dialog import SettingsDialog  # noqa: E402


def notices(app) -> list[str]:
    return [n.text for n in app.query("Notice")]


async def palette_mode_switch(app, pilot, mode: str) -> None:
    """The command palette's "Switch to MODE", as a user picks it."""
    await pilot.press("ctrl+p")
    await wait_until(pilot, lambda: app.screen.query("CommandInput"))
    for ch in f"switch to {mode}":
        await pilot.press("space" if ch == " " else ch)
    await pilot.pause(0.5)
    await pilot.press("enter")
    await wait_until(pilot, lambda: not app.screen.query("CommandInput"))


@pytest.mark.asyncio
async def test_settings_while_loading_are_applied_once_the_engine_is_ready():
    backend = SlowEngineBackend()
    app = ChatApp(backend)
    toasts: list[str] = []
    real_notify = app.notify
    app.notify = lambda message, **kw: (toasts.append(message), real_notify(message, **kw))[1]
    async with app.run_test(size=(140, 44)) as pilot:
        await pilot.pause()
        assert not app.chat_view.ready
        await pilot.press("ctrl+o")  # used to exit with InvalidSelectValueError: 'auto'
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        from textual.widgets import Input

        app.screen.query_one("#k", Input).value = "6"
        await pilot.click("#apply")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
        await app.chat_view.submit("/mode sd")  # used to print AttributeError: 'NoneType' object has no attribute 'reconfigure'
        await palette_mode_switch(app, pilot, "ar")
        await app.chat_view.submit("/temp 0.5")
        await pilot.pause()
        said = notices(app)
        assert not any("Error" in t or "NoneType" in t for t in said), said
        assert sum("the model is still loading" in t and "once it is ready" in t for t in toasts) == 4, toasts
        assert not any("still loading" in t for t in said), said  # toasts: they do not stay in the chat
        assert app.is_running and not app.chat_view.ready
        backend.release.set()
        await wait_until(pilot, lambda: app.chat_view.ready and backend.engine is not None and backend.engine.changes)
        await wait_until(pilot, lambda: any("from the next reply" in t for t in notices(app)))
        # the later choice wins (ar after sd), all in one switch
        assert backend.engine.changes == [{"k": 6, "mode": "ar"}], backend.engine.changes
        assert app.chat_view.params["temperature"] == 0.5
        await pilot.press("ctrl+o")  # now with the resolved mode
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        from textual.widgets import Select

        assert app.screen.query_one("#mode", Select).value == "ar"
        await pilot.press("escape")
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_settings_after_a_load_failure_say_so():
    backend = SlowEngineBackend(fail="no model at /nowhere")
    backend.release.set()
    app = ChatApp(backend)
    async with app.run_test(size=(140, 44)) as pilot:
        await wait_until(pilot, lambda: app.chat_view.load_error is not None)
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsDialog)
        await app.chat_view.submit("/k 5")
        await palette_mode_switch(app, pilot, "sd")
        await pilot.pause()
        said = notices(app)
        assert not any("NoneType" in t or "Error:" in t for t in said), said
        assert sum("settings cannot change: the model did not load" in t for t in said) == 3, said
        assert app.is_running
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_settings_dialog_opens_on_a_mode_it_does_not_list():
    """Any mode a backend reports (auto before loading, none in a replay) opens the dialog; applying leaves it."""
    from textual.widgets import Select

    from helpers.tui import FakeBackend

    backend = FakeBackend([ssd_events(["a"])])
    backend.info_["mode"] = "auto"
    app = ChatApp(backend)
    async with ready(app, size=(140, 44)) as pilot:
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#mode", Select).value == "auto"
        await pilot.click("#apply")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
        assert backend.info_["mode"] == "auto"
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_a_history_warning_from_the_start_is_shown_once(tmp_path):
    """A database that cannot open (here: its folder is a file) is said once, at start, not again at the first prompt."""
    from helpers.tui import FakeBackend

    from ssd_chat.history.store import History

    (tmp_path / "not-a-folder").write_text("")
    history = History(tmp_path / "not-a-folder" / "h.db")
    assert history.warning
    app = ChatApp(FakeBackend([ssd_events(["a"]), ssd_events(["b"])]), history=history)
    async with ready(app, size=(140, 44)) as pilot:
        for prompt in ("one", "two"):
            await app.chat_view.submit(prompt)
            await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        said = [t for t in notices(app) if "could not open the chat history" in t]
        assert len(said) == 1, said
        await pilot.press("ctrl+c")
