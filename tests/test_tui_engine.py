"""The app on the real engine (packaged SmolLM2, AR, greedy): the reply on screen is the engine's reply."""

from __future__ import annotations

import threading

import pytest

from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.events import Done
from ssd_chat.tui.app import ChatApp

from ssd_chat.tui.widgets.chat_log import AssistantMessage
from helpers.tui import plain, Preloaded, ready, submit, wait_until

pytestmark = pytest.mark.slow


def direct_greedy_reply(engine: Engine, prompt: str, max_new_tokens: int) -> Done:
    """The engine's reply to one user turn, run directly (no app), as the app sends it."""
    ids, extra = engine.prompt_ids([{"role": "user", "content": prompt}])
    last = [ev for ev in engine.stream(ids, SamplingParams(max_new_tokens=max_new_tokens, stop=extra), threading.Event())][-1]
    assert isinstance(last, Done)
    return last


def greedy_ar_app(smollm2, n: int) -> tuple[Engine, Done, ChatApp]:
    """An AR engine on SmolLM2, its direct greedy reply of ``n`` tokens to "Name a colour.", and the app over
    that engine set to decode the same way."""
    engine = Engine(EngineConfig(mode="ar"), smollm2)
    direct = direct_greedy_reply(engine, "Name a colour.", n)
    return engine, direct, ChatApp(Preloaded(engine), settings={"sampling": SamplingParams.given({"max_new_tokens": n, "temperature": 0.0, "repetition_penalty": 1.0})})


@pytest.mark.asyncio
async def test_real_engine_reply_matches_a_direct_greedy_run(smollm2):
    engine, direct, app = greedy_ar_app(smollm2, 5)
    async with ready(app, 60, size=(140, 45)) as pilot:
        await submit(pilot, app, "Name a colour.", 120)
        assert app.query_one(AssistantMessage).text == direct.text
        assert app.chat_view.panel.stats.new_tokens == direct.stats.new_tokens
        setup = plain(app.chat_view.panel.query_one("#setup"))
        assert "AR" in setup and "cpu" in setup


@pytest.mark.asyncio
async def test_switching_an_ar_session_to_sd_derives_the_default_draft(smollm2):
    """Started in AR without --draft, `/mode sd` makes the shipped trained draft from the loaded target; greedy SD = AR."""
    engine, direct, app = greedy_ar_app(smollm2, 8)
    async with ready(app, 60, size=(140, 45)) as pilot:
        await app.chat_view.submit("/mode sd")
        await wait_until(pilot, lambda: engine.config.mode == "sd", timeout=60)
        assert engine.draft is not None and engine.draft.name.startswith("trained (2 shared layers")
        await app.chat_view.submit("Name a colour.")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished, timeout=120)
        assert app.query_one(AssistantMessage).text == direct.text
        setup = plain(app.chat_view.panel.query_one("#setup"))
        assert "SD" in setup and "trained (2 shared layers" in setup
    engine.close()
