"""Settings in the app on the real engine (tiny models): ``auto`` in ``/mode`` and Ctrl+O goes back to the
mode auto chose, the panel says so with its why line and the next reply decodes in it; the dialog's k
field is never empty in AR; a prompt sent while loading is a passing notification, not a chat line."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from helpers.tui import FakeBackend, plain, ready, ssd_events, wait_until

from ssd_chat.chat.backend import EngineBackend  # noqa: E402
from ssd_chat.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from ssd_chat.tui.app import ChatApp  # noqa: E402
from ssd_chat.tui.widgets.settings_dialog import SettingsDialog  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

WHY = "SD: measured fastest here (AR 10.0, SD 30.0, SSD 20.0 tok/s)"


def loaded_in_auto(folder: Path, tmp_path, monkeypatch) -> Engine:
    """``Engine.load`` with ``auto`` as the app does it, on a machine whose stored probe says SD is fastest."""
    from ssd_chat.engine.startup import probe
    from ssd_chat.engine.startup import probe_store as ps
    from ssd_chat.engine.startup import preflight

    monkeypatch.setenv("SSD_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # room for SSD's speculator: auto probes
    cfg = EngineConfig(target=str(folder), draft="layers:1", mode="auto", target_device="cpu", dtype="float32")
    pre = preflight.check(cfg)
    measured = probe.Result({"ar": 10.0, "sd": 30.0, "ssd": 20.0}, 2, {"sd": 2.0, "ssd": 2.0}, {"sd": 1.5, "ssd": 1.5}, 0.5)
    ps.write(ps.key_fields(pre.config, pre.draft), probe.record(measured, ps.Load(0.1, 2.0, 2, 2), 1.0))
    engine = Engine.load(cfg)
    assert engine.config.mode == "sd" and engine.mode_reason.startswith(WHY)
    return engine


class Preloaded(EngineBackend):
    """The real backend over an engine the test made (tiny models; ``auto`` settled on SD)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__({"mode": "auto", "target": "tiny-target"})
        self._engine = engine

    def load(self, progress) -> None:
        self.engine = self._engine

    def close(self) -> None:
        self._engine.close()
        self.engine = None


def setup_text(app) -> str:
    return " ".join(plain(app.chat_view.panel.query_one("#setup")).split())


async def reply(app, pilot, prompt: str):
    """Send ``prompt``; the finished reply's stats (what really decoded it)."""
    view = app.chat_view
    before = view.current
    await view.submit(prompt)
    await wait_until(pilot, lambda: view.current is not before and view.current is not None and view.current.finished, 60)
    return view.panel.stats


@pytest.mark.asyncio
async def test_mode_auto_goes_back_to_autos_choice_from_the_command_and_the_dialog(tiny_chat_dir, tmp_path,  # noqa: F811
                                                                                       monkeypatch):
    from textual.widgets import Input, Select

    engine = loaded_in_auto(tiny_chat_dir, tmp_path, monkeypatch)
    app = ChatApp(Preloaded(engine), settings={"sampling": SamplingParams.given({"max_new_tokens": 8, "temperature": 0.0})})
    async with ready(app, size=(150, 50)) as pilot:
        await pilot.pause()
        assert "auto → SD" in setup_text(app) and f"why {WHY}" in setup_text(app), setup_text(app)
        for way in ("command", "dialog"):
            await app.chat_view.submit("/mode ar")
            assert "auto" not in setup_text(app) and "why" not in setup_text(app), setup_text(app)
            stats = await reply(app, pilot, f"in AR ({way})")
            assert stats.mode == "ar" and stats.rounds == 0
            if way == "command":
                await app.chat_view.submit("/mode auto")
            else:
                await pilot.press("ctrl+o")
                await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
                select = app.screen.query_one("#mode", Select)
                assert "auto" in [value for _, value in select._options] and select.value == "ar"
                assert app.screen.query_one("#k", Input).value == "2"  # AR: the k SD / SSD would use
                select.value = "auto"
                await pilot.click("#apply")
                await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
            await wait_until(pilot, lambda: "auto → SD" in setup_text(app))
            assert f"why {WHY}" in setup_text(app), setup_text(app)
            said = [n.text for n in app.query("Notice")]
            assert any(t.startswith(f"from the next reply: mode auto (SD on this machine) — {WHY}") for t in said), said
            stats = await reply(app, pilot, f"in auto ({way})")
            assert stats.mode == "sd" and stats.rounds > 0, stats  # it really decoded in SD
        # the dialog opens on AUTO while auto is in force; leaving it there changes nothing
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#mode", Select).value == "auto"
        await pilot.click("#apply")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
        assert engine.auto and engine.config.mode == "sd"
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_the_settings_dialog_shows_k_and_fan_out_in_ar(tiny_target, tiny_draft):
    """Started in AR with k 4: the dialog shows 4 (not an empty field), and applying untouched changes nothing."""
    from textual.widgets import Input

    engine = Engine(EngineConfig(target="tiny-target", draft="layers:1", mode="ar", k=4, fan_out="uniform:2"), tiny_target, tiny_draft)
    app = ChatApp(Preloaded(engine))
    async with ready(app, size=(150, 50)) as pilot:
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#k", Input).value == "4"
        assert app.screen.query_one("#fan_out", Input).value == "uniform:2"
        await pilot.click("#apply")
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
        assert not [n.text for n in app.query("Notice") if "from the next reply" in n.text]
        await app.chat_view.submit("/mode ssd")
        assert (engine.config.mode, engine.config.k, engine.config.fan_out) == ("ssd", 4, "uniform:2")
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_a_prompt_sent_while_loading_leaves_no_line_in_the_chat():
    class Slow(FakeBackend):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            self.release = threading.Event()

        def load(self, progress) -> None:
            self.release.wait(30)

    backend = Slow([ssd_events(["hi"])])
    app = ChatApp(backend)
    async with app.run_test(size=(140, 44), notifications=True) as pilot:
        app.chat_view.prompt.set_text("hello")
        await app.chat_view.submit("hello")
        await wait_until(pilot, lambda: app.screen.query("Toast"))
        assert any("the model is still loading; your prompt stays in the box" in str(t.render()) for t in app.screen.query("Toast"))
        assert app.chat_view.prompt.text == "hello" and backend.calls == []
        backend.release.set()
        await wait_until(pilot, lambda: app.chat_view.ready)
        assert not [n.text for n in app.query("Notice") if "still loading" in n.text]
        await app.chat_view.submit("hello")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_the_settings_dialog_shows_the_k_started_with_while_loading():
    from textual.widgets import Input

    from helpers.tui import SlowEngineBackend

    backend = SlowEngineBackend()
    app = ChatApp(backend, settings={"k": 5})
    async with app.run_test(size=(140, 44)) as pilot:
        await pilot.pause()
        assert not app.chat_view.ready
        await pilot.press("ctrl+o")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
        assert app.screen.query_one("#k", Input).value == "5"
        await pilot.press("escape")
        backend.release.set()
        await wait_until(pilot, lambda: app.chat_view.ready)
        await pilot.press("ctrl+c")
    assert app.return_code == 0


@pytest.mark.asyncio
async def test_compare_leaves_auto_in_force(tiny_chat_dir, tmp_path, monkeypatch):  # noqa: F811
    """Ctrl+G switches through AR, SD and SSD; afterwards the engine is back in auto, not in a mode it named."""
    engine = loaded_in_auto(tiny_chat_dir, tmp_path, monkeypatch)
    app = ChatApp(Preloaded(engine), settings={"sampling": SamplingParams.given({"max_new_tokens": 4, "temperature": 0.0})})
    async with ready(app, size=(150, 50)) as pilot:
        await app.chat_view.submit("/compare hi")
        await wait_until(pilot, lambda: app.chat_view.switching is None and any("outputs:" in n.text for n in app.query("Notice")), 240)
        assert engine.auto and engine.config.mode == "sd"
        await pilot.pause()
        assert "auto → SD" in setup_text(app) and f"why {WHY}" in setup_text(app), setup_text(app)
        await pilot.press("ctrl+c")
    assert app.return_code == 0
