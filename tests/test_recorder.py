"""Event logs: write, read back the same events, replay at recorded timing, and play in the app."""

from __future__ import annotations

import json
import threading
import time

import pytest
from typer.testing import CliRunner

from ssd_chat.cli import app as cli_app
from ssd_chat.engine.events import Done, Round, Token
from ssd_chat.chat.recorder import Recorder, RecordingError, read, replay

from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage
from helpers.tui import plain, ready, ssd_events, wait_until
from helpers.history import make_recording, shipped, WORDS

def test_round_trip_gives_the_same_events(tmp_path):
    e1, e2 = ssd_events(WORDS, hits=[True, False]), ssd_events(["Yes", "."])
    make_recording(tmp_path / "r.jsonl", [("first", e1), ("second", e2)])
    rec = read(tmp_path / "r.jsonl")
    assert [t.prompt for t in rec.turns] == ["first", "second"]
    assert rec.turns[0].events == e1 and rec.turns[1].events == e2
    assert rec.info["mode"] == "ssd" and rec.info["vocab"] == {900: "x", 950: "zz"}
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["format"] == "ssd-chat-events"
    assert all("turn" in json.loads(line) for line in lines[2:-1])


def test_replay_keeps_recorded_timing_scaled_by_speed():
    events = [Token(1, "a", "target", 0.0), Token(2, "b", "target", 0.3), Token(3, "c", "target", 0.6)]
    events.append(Done("length", "abc", (1, 2, 3), ssd_events(["x"])[-1].stats))
    now = [0.0]
    slept: list[float] = []

    class FakeStop(threading.Event):
        def wait(self, timeout=None):
            slept.append(round(timeout, 6))
            now[0] += timeout
            return False

    out = list(replay(events, speed=2.0, stop=FakeStop(), clock=lambda: now[0]))
    assert out == events
    assert slept == [0.15, 0.15]  # 0.3 s apart at speed 2


def test_replay_stops_with_a_cancelled_done():
    events = [Token(1, "a", "target", 0.0), Token(2, "b", "target", 5.0), Done("eos", "ab", (1, 2), ssd_events(["x"])[-1].stats)]
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    t0 = time.monotonic()
    out = list(replay(events, 1.0, stop))
    assert time.monotonic() - t0 < 4
    assert out[0] == events[0] and isinstance(out[-1], Done) and out[-1].reason == "cancelled" and out[-1].text == "a"


@pytest.mark.parametrize("content, needle", [
    ("", "empty or not an ssd-chat event log"),
    ('{"type": "Header", "format": "other"}\n', "not an ssd-chat event log"),
    ('{"type": "Header", "format": "ssd-chat-events", "version": 1}\nnot json\n', "line 2"),
    ('{"type": "Header", "format": "ssd-chat-events", "version": 1}\n{"type": "Nope"}\n', "line 2"),
    ('{"type": "Token", "id": 1, "text": "a"}\n', "before the header"),
])
def test_bad_files_are_reported_with_their_line(tmp_path, content, needle):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    with pytest.raises(RecordingError, match=needle):
        read(p)
    with pytest.raises(RecordingError, match="no recording"):
        read(tmp_path / "missing.jsonl")


def test_demo_replay_of_a_bad_file_is_one_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text("{}")
    r = CliRunner().invoke(cli_app, ["demo", "--replay", str(p)])
    assert r.exit_code == 1 and "Traceback" not in r.output and "line 1" in r.stderr
    r = CliRunner().invoke(cli_app, ["demo", "--replay", str(p), "--speed", "0"])
    assert r.exit_code == 2


@pytest.mark.asyncio
async def test_replay_in_the_app_types_prompts_and_shows_recorded_rounds(tmp_path):
    from ssd_chat.tui.app import ChatApp
    from ssd_chat.chat.backend import ReplayBackend

    e1, e2 = ssd_events(WORDS, hits=[True, False]), ssd_events(["Fine", "."], hits=[False])
    make_recording(tmp_path / "r.jsonl", [("first question", e1), ("second", e2)])
    backend = ReplayBackend(read(tmp_path / "r.jsonl"), speed=50.0)
    app = ChatApp(backend, type_delay_s=0.0)
    async with app.run_test(size=(150, 45)) as pilot:
        await wait_until(pilot, lambda: len(app.chat_view.messages) == 4 and app.chat_view.current.finished, timeout=20)
        assert [u.text for u in app.query(UserMessage)] == ["first question", "second"]
        assert [m.text for m in app.query(AssistantMessage)] == ["".join(WORDS), "Fine."]
        assert app.chat_view.panel.stats == e2[-1].stats
        assert "(replay)" in plain(app.chat_view.panel.query_one("#setup"))
        rounds = [e for e in e1 + e2 if isinstance(e, Round)]
        assert [r.index for r in app.chat_view.cache.rows][-3:] == [r.index for r in rounds][-3:]
        # candidate ids are named from the recording's vocabulary
        miss = next(r for r in app.chat_view.cache.rows if r.hit is False and r.predicted)
        assert "zz" in str(app.chat_view.cache.predicted_cell(miss))


def test_shipped_recordings_are_real_ssd_runs_with_hits_and_misses():
    assert shipped(), "no recorded session in assets/recordings"
    ssd_files = 0
    for path in shipped():
        rec = read(path)
        events = [e for t in rec.turns for e in t.events]
        rounds = [e for e in events if isinstance(e, Round)]
        done = [e for e in events if isinstance(e, Done)]
        assert len(done) == len(rec.turns) and all(d.text for d in done)
        if rec.info.get("mode") == "ssd":
            ssd_files += 1
            assert {r.cache_hit for r in rounds if r.cache_hit is not None} == {True, False}
            assert any(r.predicted for r in rounds)
        # Token texts are a prefix of each Done's text (Done.text is authoritative)
        for t in rec.turns:
            streamed = "".join(e.text for e in t.events if isinstance(e, Token))
            assert [e for e in t.events if isinstance(e, Done)][0].text.startswith(streamed)
    assert ssd_files >= 1


@pytest.mark.asyncio
async def test_shipped_recording_plays_in_the_app():
    from ssd_chat.tui.app import ChatApp
    from ssd_chat.chat.backend import ReplayBackend

    path = next(p for p in shipped() if read(p).info.get("mode") == "ssd")
    rec = read(path)
    app = ChatApp(ReplayBackend(rec, speed=1000.0), type_delay_s=0.0)
    replies = [t for t in rec.turns if t.events]
    async with app.run_test(size=(150, 45)) as pilot:
        await wait_until(pilot, lambda: len(app.chat_view.messages) == 2 * len(replies) and app.chat_view.current.finished, timeout=60)
        shown = [m.text for m in app.query(AssistantMessage)]
        assert shown == [[e for e in t.events if isinstance(e, Done)][0].text for t in replies]
        assert any(r.hit for r in app.chat_view.cache.rows) or any(r.hit is False for r in app.chat_view.cache.rows)


@pytest.mark.asyncio
async def test_app_record_writes_what_a_replay_plays_back(tmp_path):
    from ssd_chat.tui.app import ChatApp
    from helpers.tui import FakeBackend

    events = ssd_events(WORDS, hits=[True, False])
    rec = Recorder(tmp_path / "s.jsonl", {"mode": "ssd", "target": "fake-target"})
    app = ChatApp(FakeBackend([events]), recorder=rec)
    async with ready(app, size=(120, 40)) as pilot:
        await app.chat_view.submit("record me")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        await pilot.press("ctrl+c")
    back = read(tmp_path / "s.jsonl")
    assert [t.prompt for t in back.turns] == ["record me"]
    assert back.turns[0].events == events
    assert back.turns[0].settings["mode"] == "ssd"
    assert back.info["vocab"][900] == "x"  # predicted ids the backend could name
