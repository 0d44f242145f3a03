"""The panel's speedups say where they come from: measured against a reply in this chat that ran in the
other mode, estimated otherwise; the reason auto chose the mode is shown next to it."""

from __future__ import annotations

import dataclasses

import pytest

from ssd_chat.engine.events import Done
from ssd_chat.tui.widgets.figures import Baseline, baseline_from_reply, panel_values

from helpers.tui import FakeBackend, plain, ready, ssd_events, wait_until, WORDS


def ar_events(words: list[str], dt: float) -> list:
    from ssd_chat.engine.events import Token
    from ssd_chat.engine.metrics import Metrics

    m = Metrics("ar")
    evs = []
    for i, w in enumerate(words):
        ev = Token(100 + i, w, "target", (i + 1) * dt)
        m.add(ev)
        evs.append(ev)
    return evs + [Done("eos", "".join(words), tuple(range(100, 100 + len(words))), m.stats(len(words) * dt))]


@pytest.mark.asyncio
async def test_an_ar_reply_in_the_chat_makes_the_next_ssd_reply_measured():
    from ssd_chat.tui.app import ChatApp

    ssd = ssd_events(WORDS)
    ar = ar_events(WORDS, dt=0.002)  # SSD 2x faster: under its bound (mean accepted length)
    backend = FakeBackend([ssd, ar, ssd_events(WORDS)])
    app = ChatApp(backend)
    async with ready(app, size=(150, 50)) as pilot:
        await app.chat_view.submit("first")  # SSD, nothing measured yet: no AR figure (no 1-row step to cost AR with), and the panel says so
        await wait_until(pilot, lambda: app.chat_view.current.finished)
        assert app.chat_view.panel.values["vs_ar"] == "—" and app.chat_view.panel.values["basis"] == "AR: not measured · SD: estimate"
        backend.info_["mode"] = "ar"
        await app.chat_view.submit("second")  # AR: its decode rate is now this chat's AR baseline
        await wait_until(pilot, lambda: app.chat_view.current.finished and app.chat_view.current.index == 1)
        backend.info_["mode"] = "ssd"
        await app.chat_view.submit("third")
        await wait_until(pilot, lambda: app.chat_view.current.finished and app.chat_view.current.index == 2)
        want = ssd[-1].stats.tok_per_s / ar[-1].stats.tok_per_s
        assert app.chat_view.panel.values["vs_ar"] == f"{want:.2f}× meas."
        assert app.chat_view.panel.values["basis"] == "AR: AR reply 2 in this chat · SD: estimate"
        assert "AR reply 2 in this chat" in plain(app.chat_view.panel.query_one("#figures"))
        await app.action_new_chat()  # another chat: that reply is not "in this chat" any more
        assert "ar" not in app.chat_view.panel.measured


def test_a_given_bench_baseline_is_kept_over_replies():
    from ssd_chat.tui.widgets.metrics_panel import MetricsPanel

    p = MetricsPanel()
    p.set_measured(Baseline("ar", 10.0, "bench x.json", explicit=True))
    p.set_measured(Baseline("ar", 20.0, "AR reply 1 in this chat"))
    assert p.measured["ar"].source == "bench x.json"
    p.forget_replies()
    assert p.measured["ar"].source == "bench x.json"


def test_a_short_reply_is_no_baseline_and_labels_follow_the_mode_that_ran():
    s = ssd_events(WORDS)[-1].stats
    assert baseline_from_reply(dataclasses.replace(s, new_tokens=3), "x") is None
    b = baseline_from_reply(s, "x")
    assert b is not None and b.mode == "ssd" and b.tok_per_s == s.tok_per_s
    sd = dataclasses.replace(s, mode="sd")
    v = panel_values(sd, {"sd": Baseline("sd", 1.0, "SD reply 1 in this chat")})
    assert v["vs_sd"] == "—" and "SD:" not in v["basis"]  # an SD reply is never compared with SD


@pytest.mark.asyncio
async def test_the_panel_says_why_auto_chose_the_mode():
    from ssd_chat.tui.app import ChatApp

    backend = FakeBackend([])
    backend.info_.update(mode="ar", mode_reason="AR: this process has 1 CPU core; a second core would enable SSD")
    app = ChatApp(backend)
    async with ready(app, size=(150, 50)) as pilot:
        await pilot.pause()
        setup = plain(app.chat_view.panel.query_one("#setup"))
        assert "why" in setup and "a second core would enable SSD" in " ".join(setup.split())
        assert "tok/s" in plain(app.chat_view.panel.query_one("#figures"))  # the figures are drawn before the first reply


def test_engine_backend_reports_the_reason_only_while_the_mode_is_unchanged(tiny_target, tiny_draft):
    from ssd_chat.engine import Engine, EngineConfig
    from ssd_chat.chat.backend import EngineBackend

    b = EngineBackend({})
    b.engine = Engine(EngineConfig(mode="ar"), tiny_target, tiny_draft, mode_reason="AR: why")
    assert b.info()["mode_reason"] == "AR: why"
    b.engine.reconfigure(mode="sd")
    assert b.info()["mode_reason"] is None


def test_describe_says_where_ssd_runs_without_starting_the_speculator(tiny_target, tiny_draft, monkeypatch):
    """The panel's setup rows come from Engine.describe(): SSD's placement from its plan, before any decoder exists."""
    from ssd_chat.engine import Engine, EngineConfig
    from ssd_chat.engine.load import models
    from ssd_chat.engine.speculate import plan as ssd_plan

    monkeypatch.setattr(ssd_plan.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(models.os, "sched_getaffinity", lambda pid: {0, 1})
    e = Engine(EngineConfig(mode="ssd", k=3, fan_out="uniform:2"), tiny_target, tiny_draft)
    d = e.describe()
    assert e._decoder is None  # describing starts nothing
    assert (d["mode"], d["k"], d["fan_out"], d["target"], d["draft"]) == ("ssd", 3, "uniform:2", tiny_target.name, tiny_draft.name)
    # with what each computes in: the tiny models' dtype (a GGUF target on the CPU says "gguf Q4_1")
    assert d["draft_device"] == "speculator on cpu (cores 1), float64" and d["target_device"].endswith("(cores 0) float64")
    assert (d["precision"], d["draft_precision"]) == ("float64", "float64")
    e.reconfigure(mode="ar")
    d = e.describe()
    assert (d["k"], d["fan_out"], d["draft"], d["draft_device"]) == (None, None, None, None)


def test_engine_config_from_settings_takes_its_own_fields():
    from ssd_chat.chat.settings import resolve
    from ssd_chat.engine import EngineConfig

    values, _ = resolve({"mode": "sd", "k": 4, "temperature": 0.7, "record": "x.jsonl"})
    cfg = EngineConfig.from_settings(values)
    assert (cfg.mode, cfg.k, cfg.fallback, cfg.saguaro_c) == ("sd", 4, "auto", 1.0)  # unset (None) settings: the engine's defaults
    assert not hasattr(cfg, "temperature")


@pytest.mark.asyncio
async def test_the_figures_lay_out_the_screen_only_when_their_height_changes(monkeypatch):
    """A streaming reply redraws the figures ten times a second; a layout of the whole screen each time
    halved the app's decode rate, so an update of the same height only repaints, and one that
    wraps to more lines still lays out (nothing is cut)."""
    from textual.widgets import Static

    from ssd_chat.tui.app import ChatApp

    app = ChatApp(FakeBackend([ssd_events(WORDS)]))
    async with ready(app, size=(150, 50)) as pilot:
        await pilot.pause()  # the panel's first drawing, once the screen has its layout
        fig = app.chat_view.panel.query_one("#figures", Static)
        seen: list[bool] = []
        real = Static.update

        def spy(self, content="", *, layout=True):
            if self is fig:
                seen.append(layout)
            return real(self, content, layout=layout)

        monkeypatch.setattr(Static, "update", spy)
        app.chat_view.panel._render_figures()
        app.chat_view.panel._render_figures()
        assert seen == [False, False]
        app.chat_view.panel.values = {**app.chat_view.panel.values, "basis": "a long explanation " * 12}  # wraps onto more lines
        app.chat_view.panel._render_figures()
        assert seen[-1] is True
        await pilot.pause()
        assert fig.size.height >= len(app.chat_view.panel.values) + 3
