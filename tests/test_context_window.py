"""A chat longer than the model's context window goes on: the oldest turns are left out of the
prompt (the system prompt stays) and a notice says how many, in `ask`/the demo's Session and in the app."""

from __future__ import annotations

import threading

import pytest
import torch

from helpers.models import as_loaded, tiny_llama
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.events import Done, Notice
from ssd_chat.chat.session import Session, fit_context, reply_room

from helpers.tui import ready, submit

WINDOW = 192  # tokens: a few short turns fill it
PARAMS = SamplingParams(max_new_tokens=6)
SYSTEM = "Answer in one word."


@pytest.fixture(scope="module")
def small_context(smol_tokenizer):
    model = tiny_llama(vocab_size=len(smol_tokenizer), max_pos=WINDOW, dtype=torch.float32)
    return as_loaded(model, smol_tokenizer, "tiny-192")


def history(turns: int) -> list[dict[str, str]]:
    out = []
    for i in range(turns):
        out += [{"role": "user", "content": f"Question number {i}: what comes after {i}?"},
                {"role": "assistant", "content": f"The number after {i} is {i + 1}, of course."}]
    return out


def test_fit_context_leaves_out_the_fewest_oldest_turns(small_context):
    engine = Engine(EngineConfig(mode="ar"), small_context)
    msgs = [{"role": "system", "content": SYSTEM}, *history(8), {"role": "user", "content": "And after 8?"}]
    full, _ = engine.prompt_ids(msgs)
    assert len(full) > WINDOW  # the whole chat does not fit at all
    ids, _, dropped = fit_context(engine, msgs, PARAMS)
    room = reply_room(engine, PARAMS, WINDOW)
    assert 0 < dropped < 8 and len(ids) + room <= WINDOW
    kept = [{"role": "system", "content": SYSTEM}, *history(8)[2 * dropped:], msgs[-1]]
    assert ids == engine.prompt_ids(kept)[0]  # the newest turns, whole, with the system prompt
    one_more = [{"role": "system", "content": SYSTEM}, *history(8)[2 * (dropped - 1):], msgs[-1]]
    assert len(engine.prompt_ids(one_more)[0]) + room > WINDOW  # no turn was dropped that would have fit
    text = small_context.tokenizer.decode(ids)
    assert SYSTEM in text and "And after 8?" in text and "Question number 0:" not in text


def test_a_long_session_keeps_answering_with_a_notice(small_context):
    engine = Engine(EngineConfig(mode="ar"), small_context)
    session = Session(engine, system=SYSTEM, messages=history(8))
    events = list(session.stream("And after 8?", PARAMS, threading.Event()))
    notices = [e for e in events if isinstance(e, Notice)]
    assert len(notices) == 1 and "context of 192 tokens" in notices[0].message
    assert "the oldest" in notices[0].message and "system prompt is kept" in notices[0].message
    assert isinstance(events[-1], Done) and events[-1].stats.new_tokens >= 1
    assert len(session.messages) == 18  # the session itself keeps every turn
    short = Session(engine, system=SYSTEM)
    assert not any(isinstance(e, Notice) for e in short.stream("Hi", PARAMS, threading.Event()))


def test_a_single_message_longer_than_the_window_is_still_a_clear_error(small_context):
    engine = Engine(EngineConfig(mode="ar"), small_context)
    with pytest.raises(ParamError, match="context of 192 tokens"):
        list(Session(engine).stream("word " * 400, PARAMS, threading.Event()))


@pytest.mark.asyncio
async def test_the_app_keeps_chatting_past_the_window(small_context):
    from helpers.tui import Preloaded

    from ssd_chat.tui.app import ChatApp

    engine = Engine(EngineConfig(mode="ar"), small_context)
    app = ChatApp(Preloaded(engine), settings={"sampling": SamplingParams.given({"max_new_tokens": 6, "temperature": 0.0}), "system": SYSTEM})
    async with ready(app, 60, size=(140, 45)) as pilot:
        app.chat_view.messages = [*app.chat_view.messages, *history(8)]  # a long chat so far (as after --resume)
        await submit(pilot, app, "And after 8?", 60)
        assert app.chat_view.current.status == "done"
        notices = [n.text for n in app.query(".notice")]
        assert any("this reply does not see the oldest" in n for n in notices), notices
        await pilot.press("ctrl+c")
    assert app.return_code == 0
