"""Pilot tests of the chat app, driven by scripted event streams (no model)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from pathlib import Path

import pytest

from ssd_chat.engine.events import Done, Error, Event, Notice, Round, Token
from ssd_chat.engine.metrics import Metrics
from ssd_chat.history.store import History
from ssd_chat.tui.app import ChatApp
from ssd_chat.tui.widgets.figures import Baseline, panel_values, speedup_vs
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage
from ssd_chat.tui.widgets.settings_dialog import SettingsDialog
from helpers.tui import FakeBackend, plain, ready, replies_text, ssd_events, submit, wait_until, WORDS



class TestSend:
    @pytest.mark.asyncio
    async def test_a_frame_and_the_final_event_apply_one_at_a_time(self, tmp_path, monkeypatch):
        """The frame timer runs in its own task: a frame still writing tokens must not resave a finished reply."""
        import ssd_chat.tui.replies as replies_module

        monkeypatch.setattr(replies_module, "SAVE_EVERY_S", 0.0)  # every frame saves
        history = History(tmp_path / "h.db")
        app = ChatApp(FakeBackend([[]]), history=history)  # an empty stream: the events are applied by hand
        async with ready(app, size=(140, 45)):
            await app.chat_view.submit("q")
            app.chat_view.controller.replies.frames.pause()
            t = app.chat_view.current
            gate = asyncio.Event()
            write = t.widget.append

            async def slow_append(pieces):
                await gate.wait()
                await write(pieces)

            t.widget.append = slow_append
            t.pending = [Token(1, "Hi", "draft", 0.01)]
            frame = asyncio.create_task(app.chat_view.controller.replies.flush_pending())
            await asyncio.sleep(0.05)  # the frame now waits inside append
            t.widget.append = write
            t.pending.append(Done("eos", "Hi!", (1, 2), Metrics("ssd").stats(0.03)))
            final = asyncio.create_task(app.chat_view.controller.replies.flush_pending())
            await asyncio.sleep(0.05)
            gate.set()
            await asyncio.wait_for(asyncio.gather(frame, final), 10)
            assert t.finished and t.status == "done" and t.text == "Hi!"
            assert app.query_one(AssistantMessage).body.source == "Hi!"
        conv = History(tmp_path / "h.db").list_conversations()[0]
        msgs = History(tmp_path / "h.db").messages(conv.id)
        assert [(m.content, m.status) for m in msgs] == [("q", "done"), ("Hi!", "done")]

    @pytest.mark.asyncio
    async def test_prompt_streams_reply_into_chat_and_history(self, tmp_path):
        backend = FakeBackend([ssd_events(WORDS)])
        history = History(tmp_path / "h.db")
        app = ChatApp(backend, history=history)
        async with ready(app, size=(140, 45)) as pilot:
            await pilot.press(*"hi there")
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
            assert [u.text for u in app.query(UserMessage)] == ["hi there"]
            assert replies_text(app) == ["".join(WORDS)]
            md = app.query_one(AssistantMessage).body
            assert "bold" in md.source and md.source == "".join(WORDS)
            assert backend.calls[0][-1] == {"role": "user", "content": "hi there"}
            assert app.chat_view.prompt.text == ""
        conv = History(tmp_path / "h.db").list_conversations()[0]
        msgs = History(tmp_path / "h.db").messages(conv.id)
        assert [(m.role, m.content, m.status) for m in msgs] == [("user", "hi there", "done"), ("assistant", "".join(WORDS), "done")]
        assert msgs[1].metrics["mode"] == "ssd" and msgs[1].metrics["rounds"] > 0

    @pytest.mark.asyncio
    async def test_second_turn_sends_the_history(self):
        backend = FakeBackend([ssd_events(["A", "B"]), ssd_events(["C"])])
        app = ChatApp(backend, settings={"system": "be brief"})
        async with ready(app, size=(120, 40)) as pilot:
            await submit(pilot, app, "one")
            await app.chat_view.submit("two")
            await wait_until(pilot, lambda: app.chat_view.current.finished and app.chat_view.current.prompt == "two")
            assert backend.calls[1] == [
                {"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
                {"role": "assistant", "content": "AB"}, {"role": "user", "content": "two"}]

    @pytest.mark.asyncio
    async def test_multiline_entry_and_prompt_history(self):
        backend = FakeBackend([ssd_events(["ok"]), ssd_events(["ok"])])
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)) as pilot:
            await pilot.press("a", "ctrl+j", "b")
            assert app.chat_view.prompt.text == "a\nb"
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
            assert backend.calls[0][-1]["content"] == "a\nb"
            await pilot.press("up")
            assert app.chat_view.prompt.text == "a\nb"
            await pilot.press("down", "down")
            assert app.chat_view.prompt.text == ""

    @pytest.mark.asyncio
    async def test_error_event_keeps_partial_text_and_app_stays_open(self):
        events = [Token(1, "partial ", "target", 0.01), Error("boom: out of memory", "oom", "partial text", (1, 2))]
        app = ChatApp(FakeBackend([events, ssd_events(["fine"])]))
        async with ready(app, size=(120, 40)) as pilot:
            await submit(pilot, app, "go")
            assert replies_text(app) == ["partial text"]
            assert app.chat_view.current.status == "error"
            assert any("boom" in str(n.text) for n in app.query("Notice"))
            await app.chat_view.submit("again")
            await wait_until(pilot, lambda: app.chat_view.current.prompt == "again" and app.chat_view.current.finished)
            assert replies_text(app)[-1] == "fine"

    @pytest.mark.asyncio
    async def test_load_failure_is_shown_readably(self):
        class Broken(FakeBackend):
            def load(self, progress):
                progress("loading target", 0.5)
                from ssd_chat.engine.errors import ModelError

                raise ModelError("model 'nope' not found: not an alias, hub id, folder or .gguf file")

        app = ChatApp(Broken([]))
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: app.chat_view.load_error is not None)
            assert "model 'nope' not found" in app.chat_view.load_error
            assert "Traceback" not in app.chat_view.load_error
            await app.chat_view.submit("hello")  # refused politely
            assert not app.query(AssistantMessage)


class TestSession:
    @pytest.mark.asyncio
    async def test_the_app_keeps_its_conversation_in_a_session(self):
        """As in `ask` and the demo: the Session builds what the backend is asked and keeps each turn."""
        from ssd_chat.engine.load.chat import messages_for
        from ssd_chat.chat.session import Session

        backend = FakeBackend([ssd_events(["one"]), ssd_events(["two"])])
        app = ChatApp(backend, settings={"system": "be brief"})
        async with ready(app, size=(120, 40)) as pilot:
            await submit(pilot, app, "first")
            first = app.chat_view.session
            assert isinstance(first, Session) and first.system_in_force == "be brief"
            turn = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"}]
            start = [{"role": "system", "content": "be brief"}]  # a message, as in the saved chat
            assert first.messages == start + turn and app.chat_view.messages is first.messages
            await submit(pilot, app, "second")
            assert backend.calls[1] == messages_for("second", "be brief", turn)
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: app.chat_view.session is not first)
            assert app.chat_view.session.messages == start and len(first.messages) == 5


class TestStop:
    @pytest.mark.asyncio
    async def test_escape_stops_mid_reply_keeps_partial_and_prompt(self, tmp_path):
        backend = FakeBackend([ssd_events(WORDS), ssd_events(["next"])], block=True)
        history = History(tmp_path / "h.db")
        app = ChatApp(backend, history=history)
        async with ready(app, size=(120, 40)) as pilot:
            await app.chat_view.submit("tell me")
            await wait_until(pilot, lambda: backend.blocked.is_set())
            await wait_until(pilot, lambda: app.chat_view.current.text != "")
            partial = app.chat_view.current.text
            await pilot.press("escape")
            assert app.chat_view.current.finished and app.chat_view.current.status == "stopped"  # at once, not after the engine
            assert partial and "".join(WORDS).startswith(partial)
            assert app.chat_view.prompt.text == "tell me"  # the prompt is back for editing
            await wait_until(pilot, lambda: backend.thread_ended.is_set())
            await wait_until(pilot, lambda: app.chat_view.current.text.endswith("<held>"))  # Done.text is authoritative
            assert app.chat_view.messages[-1] == {"role": "assistant", "content": app.chat_view.current.text}
            # the app is still usable
            await app.chat_view.submit("go on")
            await wait_until(pilot, lambda: app.chat_view.current.prompt == "go on" and app.chat_view.current.finished)
        msgs = History(tmp_path / "h.db").messages(History(tmp_path / "h.db").list_conversations()[0].id)
        assert msgs[1].status == "stopped" and msgs[1].content.startswith(partial)

    @pytest.mark.asyncio
    async def test_a_reply_that_ends_while_esc_draws_it_is_finished_once(self, tmp_path):
        """Esc draws what had streamed; if the reply's last event arrives meanwhile, the reply ends there (done) and
        is not finished a second time as stopped (its rounds counted twice, the next prompt typed twice)."""
        events = ssd_events(WORDS)
        backend = FakeBackend([events], block=True)
        app = ChatApp(backend, history=History(tmp_path / "h.db"))
        async with ready(app, size=(120, 40)) as pilot:
            await app.chat_view.submit("tell me")
            await wait_until(pilot, lambda: backend.blocked.is_set())
            replies = app.chat_view.controller.replies
            turn = app.chat_view.current
            finished: list[str] = []
            real_finish, real_flush, real_stop = replies._finish, replies.flush_pending, replies.stop
            in_stop = asyncio.Event()

            async def stop():
                in_stop.set()
                await real_stop()

            async def finish(t, text, status, meta):
                finished.append(status)
                await real_finish(t, text, status, meta)

            async def flush_pending():  # the engine's Done lands while Esc draws the tokens before it
                if in_stop.is_set() and turn.status == "streaming" and not finished:
                    replies.inbox.extend((turn.index, ev) for ev in events[len(events) // 2:])
                await real_flush()

            replies._finish, replies.flush_pending, replies.stop = finish, flush_pending, stop
            await pilot.press("escape")
            await wait_until(pilot, lambda: finished)
            await pilot.pause(0.3)
            assert finished == ["done"] and turn.status == "done" and turn.text == "".join(WORDS)

    @pytest.mark.asyncio
    async def test_quit_while_streaming_ends_the_engine_thread(self):
        backend = FakeBackend([ssd_events(WORDS)], block=True)
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)) as pilot:
            await app.chat_view.submit("x")
            await wait_until(pilot, lambda: backend.blocked.is_set())
            await pilot.press("ctrl+c")
            await pilot.pause()
        assert backend.thread_ended.is_set()
        assert backend.closed
        assert app.return_code == 0


class TestHistory:
    @pytest.mark.asyncio
    async def test_resume_a_saved_chat(self, tmp_path):
        h = History(tmp_path / "h.db")
        cid = h.new_conversation("old question", "sys")
        h.add_message(cid, "user", "old question")
        mid = h.add_message(cid, "assistant", "old *answer*")
        h.add_message(cid, "user", "cut")
        h.add_message(cid, "assistant", "half a rep", status="streaming")  # the app died mid-reply
        h.close()
        backend = FakeBackend([ssd_events(["new"])])
        app = ChatApp(backend, history=History(tmp_path / "h.db"), resume=cid)
        async with ready(app, size=(120, 40)) as pilot:
            assert [u.text for u in app.query(UserMessage)] == ["old question", "cut"]
            assert replies_text(app) == ["old *answer*", "half a rep"]
            assert "stopped" in app.query(AssistantMessage)[1]._meta_text
            await app.chat_view.submit("more")
            await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
            assert backend.calls[0][:3] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "old question"},
                                            {"role": "assistant", "content": "old *answer*"}]
        assert len(History(tmp_path / "h.db").messages(cid)) == 7  # with the system prompt, its first message
        assert mid is not None

    @pytest.mark.asyncio
    async def test_corrupt_db_warns_and_chat_works_in_memory(self, tmp_path):
        bad = tmp_path / "h.db"
        bad.write_bytes(b"this is not sqlite at all" * 100)
        app = ChatApp(FakeBackend([ssd_events(["ok"])]), history=History(bad))
        async with ready(app, size=(120, 40)) as pilot:
            notices = [n.text for n in app.query("Notice")]
            assert any("corrupt" in n and "in memory" in n for n in notices)
            await submit(pilot, app, "hi")
            assert replies_text(app) == ["ok"]
        assert bad.read_bytes().startswith(b"this is not sqlite")  # untouched


class TestPanel:
    @pytest.mark.asyncio
    async def test_panel_values_equal_metrics_from_the_same_events(self):
        events = ssd_events(WORDS, k=3, hits=[True, False, True])
        m = Metrics("ssd")
        for ev in events:
            m.add(ev)
        done = events[-1]
        expected = m.stats(done.stats.elapsed_s)
        app = ChatApp(FakeBackend([events]))
        async with ready(app, size=(140, 45)) as pilot:
            await submit(pilot, app, "q")
            p = app.chat_view.panel
            assert p.stats == done.stats
            assert p.values["tau"] == f"{expected.mean_accepted_length:.2f}"
            assert p.values["acceptance"] == f"{expected.acceptance_rate:.1%}"
            assert p.values["cache_hit"] == f"{expected.cache_hit_rate:.1%}"
            assert p.values["tau_hit_miss"] == f"{expected.accepted_length_on_hit:.2f} / {expected.accepted_length_on_miss:.2f}"
            assert p.values["tok_per_s"] == f"{expected.tok_per_s:.1f}"
            assert p.values["per_position"] == " ".join(f"{x:.0%}" for x in expected.per_position_acceptance)
            ms = lambda v: f"{1000 * v / expected.rounds:.0f}"  # noqa: E731
            assert p.values["round_ms"] == f"{ms(expected.verify_s)} / {ms(expected.draft_s)} / {ms(expected.wait_s)}"
            assert p.values["vs_sd"].endswith("est.")
            rounds = [e for e in events if isinstance(e, Round)]
            assert list(p.accepted_lengths) == [r.accepted + 1 for r in rounds]
            assert sum(p.histogram.values()) == len(rounds)
            rendered = plain(p.query_one("#figures"))
            assert p.values["tau"] in rendered
            info = plain(p.query_one("#setup"))
            assert "SSD" in info and "fake-target" in info and "cpu:1" in info

    @pytest.mark.asyncio
    @pytest.mark.parametrize("slow_render", [False, True])
    async def test_live_values_update_while_streaming(self, slow_render, monkeypatch):
        # slow_render: events spread over several frames and Markdown rendering that yields for a while (as on a
        # loaded CI machine) must never leave the panel behind metrics that already hold the batch being rendered.
        if slow_render:
            append = AssistantMessage.append

            async def slow_append(self, pieces):
                await asyncio.sleep(0.15)
                await append(self, pieces)

            monkeypatch.setattr(AssistantMessage, "append", slow_append)
        backend = FakeBackend([ssd_events(WORDS)], block=True, delay=0.04 if slow_render else 0.0)
        app = ChatApp(backend)
        async with ready(app, size=(140, 45)) as pilot:
            await app.chat_view.submit("q")
            await wait_until(pilot, lambda: backend.blocked.is_set())
            # the panel is drawn at most every PANEL_S while streaming: held, it catches up with every applied event
            await wait_until(pilot, lambda: app.chat_view.panel.live and app.chat_view.panel.stats is not None and app.chat_view.panel.stats.rounds > 0
                             and not app.chat_view.current.pending and not app.chat_view.controller.replies.inbox)
            await wait_until(pilot, lambda: app.chat_view.panel.stats == app.chat_view.current.metrics.stats(app.chat_view.current.last_t_s))
            await pilot.press("escape")

    @pytest.mark.asyncio
    async def test_frames_space_out_when_drawing_costs_more_than_its_share(self, monkeypatch):
        """While a reply streams, the app draws at most UI_SHARE of a core: a frame that costs 10 ms of CPU
        is followed by the next about 10 ms / UI_SHARE later, not after one FRAME_S."""
        import ssd_chat.tui.replies as replies_module

        cpu = [0.0]
        monkeypatch.setattr(replies_module.time, "process_time", lambda: cpu[0])
        apply = replies_module.Replies.apply_pending
        frames: list[float] = []

        async def costly(self):
            if self.ctl.current is not None and self.ctl.current.pending:
                frames.append(time.monotonic())
                cpu[0] += 0.010 if costs[0] else 0.0
            await apply(self)

        monkeypatch.setattr(replies_module.Replies, "apply_pending", costly)
        words = [f" w{i}" for i in range(300)]
        for cost in (True, False):
            costs, frames[:] = [cost], []
            backend = FakeBackend([[Token(i, w, "target", 0.01 * i) for i, w in enumerate(words)]
                                   + [Done("eos", "".join(words), tuple(range(300)), Metrics("ar").stats(3.0))]],
                                  mode="ar", delay=0.01)
            app = ChatApp(backend)
            async with ready(app, size=(140, 45)) as pilot:
                await submit(pilot, app, "q", 30)
                assert replies_text(app) == ["".join(words)]
            gaps = [b - a for a, b in zip(frames, frames[1:-1])]  # the last one is the end's, at once
            expected = min(replies_module.MAX_FRAME_S, 0.010 / replies_module.UI_SHARE) if cost else 0.1
            assert len(gaps) >= 3 and sorted(gaps)[len(gaps) // 2] == pytest.approx(expected, rel=0.4), (cost, gaps)

    def test_speedups_name_their_source(self):
        events = ssd_events(WORDS)
        s = events[-1].stats
        sd = speedup_vs(s, "sd")
        this = s.ttft_s + s.verify_s + s.draft_s + s.wait_s
        assert sd.kind == "estimated" and sd.value == pytest.approx(s.sd_estimate_s / this)
        ar = speedup_vs(s, "ar")  # no AR rate measured: no figure (a verify is not an AR step)
        assert ar.kind == "n/a" and ar.value is None and ar.note == "not measured"
        live = dataclasses.replace(s, sd_estimate_s=None)  # SSD's SD estimate arrives with Done
        assert speedup_vs(live, "sd").value is None
        sd_reply = dataclasses.replace(s, mode="sd", sd_estimate_s=None)
        assert speedup_vs(sd_reply, "sd").kind == "n/a" and speedup_vs(sd_reply, "ar").kind == "n/a"
        meas = speedup_vs(s, "ar", Baseline("ar", s.tok_per_s / 2, "bench"))
        assert meas.kind == "measured" and meas.value == pytest.approx(2.0) and meas.bound == s.mean_accepted_length
        assert panel_values(s, {"ar": Baseline("ar", s.tok_per_s / 1.5, "bench")})["vs_ar"] == "1.50× meas."
        ar_stats = Metrics("ar").stats(1.0)
        assert speedup_vs(ar_stats, "ar").value is None and panel_values(ar_stats)["vs_ar"] == "—"


class TestCacheView:
    @pytest.mark.asyncio
    async def test_cache_view_shows_a_hit_and_a_miss(self):
        events = ssd_events(WORDS, k=3, hits=[True, False])
        app = ChatApp(FakeBackend([events]))
        async with ready(app, size=(160, 50)) as pilot:
            await submit(pilot, app, "q")
            rows = list(app.chat_view.cache.rows)
            assert {r.hit for r in rows} == {True, False}
            hit = next(r for r in rows if r.hit)
            miss = next(r for r in rows if r.hit is False and r.chosen_j is not None)
            # a hit: the previous round's outcome (j, bonus) is among the cached predictions; a miss: it is not
            assert hit.chosen_id in dict(hit.predicted)[hit.chosen_j]
            assert miss.chosen_id not in dict(miss.predicted)[miss.chosen_j]
            rounds = {e.index: e for e in events if isinstance(e, Round)}
            assert (hit.chosen_j, hit.chosen_id) == (rounds[hit.index - 1].accepted, rounds[hit.index - 1].bonus_id)
            assert hit.chosen_text == WORDS[hit.chosen_id - 100].replace("\n", "\\n")
            text = plain(app.chat_view.cache)
            assert "hit" in text and "miss" in text and "target chose" in text
            # candidate ids the backend can decode show as text, others as #id
            assert "x" in str(app.chat_view.cache.predicted_cell(miss)) and "#950" in str(app.chat_view.cache.predicted_cell(miss))


class TestSettings:
    @pytest.mark.asyncio
    async def test_switch_mode_k_temperature_between_turns(self):
        backend = FakeBackend([ssd_events(["a"])])
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)):
            await app.chat_view.submit("/mode sd")
            await app.chat_view.submit("/k 6")
            await app.chat_view.submit("/temp 0.7")
            assert backend.info_["mode"] == "sd" and backend.info_["k"] == 6
            assert app.chat_view.params["temperature"] == 0.7
            await app.chat_view.submit("/k zero")
            assert any("k must be a whole number" in n.text for n in app.query("Notice"))
            await app.chat_view.submit("/mode bogus")
            assert backend.info_["mode"] == "sd"
            assert "SD" in plain(app.chat_view.panel.query_one("#setup"))

    @pytest.mark.asyncio
    async def test_a_prompt_sent_while_the_mode_switches_waits_in_the_box(self):
        """A switch that derives a draft takes seconds in a thread; a prompt or another change
        sent meanwhile is refused with a notice (not run on the old mode), and works after."""
        release = threading.Event()

        class SlowSwitch(FakeBackend):
            def reconfigure(self, **changes):
                release.wait(10)
                super().reconfigure(**changes)

        backend = SlowSwitch([ssd_events(["hi"])])
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)) as pilot:
            k_before = backend.info_["k"]
            switch = asyncio.create_task(app.chat_view.submit("/mode sd"))
            await wait_until(pilot, lambda: app.chat_view.switching is not None)
            app.chat_view.prompt.set_text("tell me")
            await app.chat_view.submit("tell me")
            assert app.chat_view.prompt.text == "tell me" and app.chat_view.current is None and backend.calls == []
            await app.chat_view.submit(f"/k {k_before + 2}")
            notices = [n.text for n in app.query("Notice")]
            assert any("still switching to mode sd; your prompt stays in the box" in t for t in notices), notices
            assert any("still switching to mode sd; change settings after that" in t for t in notices), notices
            release.set()
            await switch
            assert app.chat_view.switching is None and backend.info_["mode"] == "sd" and backend.info_["k"] == k_before
            await app.chat_view.submit("tell me")
            await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
            assert len(backend.calls) == 1

    @pytest.mark.asyncio
    async def test_settings_dialog_applies_and_rejects_bad_values(self):
        backend = FakeBackend([])
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)) as pilot:
            await pilot.press("ctrl+o")
            await pilot.pause()
            from textual.widgets import Input

            k = app.screen.query_one("#k", Input)
            k.value = "99"
            await pilot.click("#apply")
            await pilot.pause()
            assert "between 1 and 32" in str(app.screen.query_one("#settings-error").content)
            k.value = "5"
            k.focus()
            await pilot.press("enter")  # Enter in a field applies too
            await wait_until(pilot, lambda: backend.info_["k"] == 5)
            assert not isinstance(app.screen, SettingsDialog)

    @pytest.mark.asyncio
    async def test_new_chat_copy_and_system_prompt(self):
        backend = FakeBackend([ssd_events(["copy", " me"]), ssd_events(["b"])])
        app = ChatApp(backend)
        async with ready(app, size=(120, 40)) as pilot:
            await submit(pilot, app, "a")
            await pilot.press("ctrl+y")
            assert app.chat_view.controller.actions.clipboard_text == "copy me"
            await pilot.press("ctrl+s")
            await pilot.pause()
            app.screen.query_one("#system-text").text = "You are terse."
            await pilot.press("ctrl+s")
            await wait_until(pilot, lambda: app.chat_view.system == "You are terse.")
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: not app.query(UserMessage))
            assert app.chat_view.messages == [{"role": "system", "content": "You are terse."}]  # the new chat starts with it
            await submit(pilot, app, "b")
            assert backend.calls[1] == [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "b"}]

    @pytest.mark.asyncio
    async def test_token_colouring_is_off_by_default_and_toggles(self):
        app = ChatApp(FakeBackend([ssd_events(WORDS)]))
        async with ready(app, size=(120, 40)) as pilot:
            await submit(pilot, app, "q")
            msg = app.query_one(AssistantMessage)
            assert not msg.has_class("-colour")
            await pilot.press("ctrl+t")
            assert msg.has_class("-colour")
            spans = msg._coloured().spans
            styles = {str(s.style) for s in spans}
            assert {"green", "bold yellow"} <= styles


@pytest.mark.asyncio
async def test_q_in_prompt_is_text():
    app = ChatApp(FakeBackend([]))
    async with ready(app, size=(120, 40)) as pilot:
        await pilot.press("q")
        assert app.chat_view.prompt.text == "q"
        assert app.is_running
        await pilot.press("ctrl+r")  # in a dialog, q is not quit either
        await wait_until(pilot, lambda: app.screen.query("#chat-list"))
        await pilot.press("q")
        await pilot.pause()
        assert app.is_running
        await pilot.press("escape")
        await wait_until(pilot, lambda: not app.screen.query("#chat-list"))
        app.chat_view.chat.focus()  # elsewhere, q quits
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running and app.return_code == 0


@pytest.mark.asyncio
async def test_a_crash_mid_reply_keeps_what_streamed(tmp_path):
    """The streaming reply is saved while it streams: the database has it before the reply ends."""
    backend = FakeBackend([ssd_events(WORDS)], block=True)
    app = ChatApp(backend, history=History(tmp_path / "h.db"))
    async with ready(app, size=(120, 40)) as pilot:
        await app.chat_view.submit("q")
        await wait_until(pilot, lambda: backend.blocked.is_set() and app.chat_view.current.text)

        def saved():
            other = History(tmp_path / "h.db")
            try:
                return [(m.content, m.status) for m in other.messages(app.chat_view.conversation_id) if m.role == "assistant"]
            finally:
                other.close()

        await wait_until(pilot, lambda: saved() and saved()[0][0] != "")
        content, status = saved()[0]
        assert status == "streaming" and "".join(WORDS).startswith(content) and content
        await pilot.press("escape")


def bench_report(tmp_path, ar: float, sd: float) -> Path:
    mode = lambda v: {"tok_per_s": {"median": v, "p25": v, "p75": v, "min": v, "max": v, "n": 3}}  # noqa: E731
    report = {"schema": "x", "models": {"target": {"name": "fake-target"}},
              "protocols": {"paper": {"modes": {"ar": mode(1.0), "sd": mode(1.0)}},
                            "equal": {"modes": {"ar": mode(ar), "sd": mode(sd), "ssd": mode(99.0)}}}}
    path = tmp_path / "bench.json"
    path.write_text(__import__("json").dumps(report))
    return path


def test_baselines_from_a_bench_report(tmp_path):
    from ssd_chat.tui.widgets.figures import baselines_from_bench

    bs = {b.mode: b for b in baselines_from_bench(bench_report(tmp_path, 20.0, 40.0))}
    assert bs["ar"].tok_per_s == 20.0 and bs["sd"].tok_per_s == 40.0 and "equal" in bs["ar"].source
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not an `ssd-chat bench --json` report"):
        baselines_from_bench(bad)
    with pytest.raises(ValueError, match="no bench report"):
        baselines_from_bench(tmp_path / "missing.json")


@pytest.mark.asyncio
async def test_measured_baselines_make_the_speedups_measured(tmp_path):
    from ssd_chat.tui.widgets.figures import baselines_from_bench

    events = ssd_events(WORDS)
    tps = events[-1].stats.tok_per_s
    # under their bounds: this reply's mean accepted length (2.0) and 1 + draft/verify of its SD estimate (1.93)
    app = ChatApp(FakeBackend([events]), baselines=baselines_from_bench(bench_report(tmp_path, tps / 1.5, tps / 1.25)))
    async with ready(app, size=(140, 45)) as pilot:
        await submit(pilot, app, "q")
        assert app.chat_view.panel.values["vs_ar"] == "1.50× meas."
        assert app.chat_view.panel.values["vs_sd"] == "1.25× meas."


@pytest.mark.asyncio
async def test_load_progress_is_shown_and_quit_during_load_does_not_wait():
    class Slow(FakeBackend):
        gate = threading.Event()

        def load(self, progress):
            progress("loading target smollm2", 0.4)
            self.gate.wait(30)

    backend = Slow([])
    app = ChatApp(backend)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_until(pilot, lambda: "loading target smollm2" in str(app.query_one("#load-stage").content))
            assert app.query_one("#load-bar").percentage == pytest.approx(0.4)
            await pilot.press("ctrl+c")
            await pilot.pause()
        assert app.return_code == 0 and not app.chat_view.ready
        loaders = [t for t in threading.enumerate() if t.name == "ssd-chat-load"]
        assert loaders and all(t.daemon for t in loaders)  # cannot keep the process alive
    finally:
        Slow.gate.set()


@pytest.mark.asyncio
async def test_chats_dialog_resumes_and_deletes(tmp_path):
    h = History(tmp_path / "h.db")
    keep = h.new_conversation("keep me")
    h.add_message(keep, "user", "keep me")
    h.add_message(keep, "assistant", "kept")
    drop = h.new_conversation("drop me")
    h.add_message(drop, "user", "drop me")
    app = ChatApp(FakeBackend([]), history=h)
    async with ready(app, size=(120, 40)) as pilot:
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: app.screen.query("#chat-list"))
        ol = app.screen.query_one("#chat-list")
        assert ol.option_count == 2
        ol.highlighted = [ol.get_option_at_index(i).id for i in range(2)].index(str(drop))
        await pilot.press("d", "y")  # d asks first (tests/test_tui_rerun.py)
        await wait_until(pilot, lambda: ol.option_count == 1)
        assert h.get_conversation(drop) is None
        ol.highlighted = 0
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat_view.conversation_id == keep and app.chat_view.messages)
        assert app.chat_view.messages == [{"role": "user", "content": "keep me"}, {"role": "assistant", "content": "kept"}]


@pytest.mark.asyncio
async def test_command_palette_lists_mode_switches_and_actions():
    app = ChatApp(FakeBackend([]))
    async with ready(app, size=(120, 40)) as pilot:
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {"New chat", "Copy last reply", "System prompt", "Settings", "Switch to AR", "Switch to SD",
                "Switch to SSD", "Chats", "Toggle token colours", "Stop reply"} <= titles
        assert {"Export chat as Markdown", "Export chat as JSONL"} <= titles
        cmd = next(c for c in app.get_system_commands(app.screen) if c.title == "Switch to SD")
        cmd.callback()
        await wait_until(pilot, lambda: app.backend.info_["mode"] == "sd")


@pytest.mark.asyncio
async def test_export_from_the_app_writes_the_chat_with_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("SSD_CHAT_DATA_DIR", str(tmp_path / "data"))
    app = ChatApp(FakeBackend([ssd_events(["An", " answer"])]), history=History(tmp_path / "h.db"))
    async with ready(app, size=(120, 40)) as pilot:
        assert app.chat_view.controller.actions.export_chat("md") is None  # nothing yet
        await submit(pilot, app, "a question")
        md = app.chat_view.controller.actions.export_chat("md").read_text()
        assert "a question" in md and "An answer" in md and "τ" in md
        rows = [__import__("json").loads(x) for x in app.chat_view.controller.actions.export_chat("jsonl").read_text().splitlines()]
        assert rows[-1]["content"] == "An answer" and rows[-1]["metrics"]["mode"] == "ssd"


@pytest.mark.asyncio
async def test_cache_view_for_sd_rounds_shows_their_own_outcome():
    events = [Token(1, "Hi", "draft", 0.01), Token(2, "!", "target", 0.02),
              Round(0, (1, 5), 1, 2, 2, 0.001, 0.002, 0.02), Done("eos", "Hi!", (1, 2), Metrics("sd").stats(0.03))]
    app = ChatApp(FakeBackend([events], mode="sd"))
    async with ready(app, size=(150, 40)) as pilot:
        await submit(pilot, app, "q")
        [row] = app.chat_view.cache.rows
        assert row.hit is None and row.bonus_text == "!" and row.accepted == 1
        text = plain(app.chat_view.cache)
        assert "accepted 1 + !" in text and "no speculation cache (SD)" in text


def switched_events(words: list[str], after: int) -> list[Event]:
    """An SSD stream whose speculator fails after ``after`` rounds: the rest runs as SD (what the engine emits)."""
    evs = ssd_events(words)
    rounds = [i for i, e in enumerate(evs) if isinstance(e, Round)]
    note = Notice("the speculator process exited unexpectedly; continuing as SD", "warning", mode="sd", after_round=after)
    evs.insert(rounds[after - 1] + 1, note)
    done = evs[-1]
    evs[-1] = dataclasses.replace(done, stats=dataclasses.replace(done.stats, ran_as="sd", switched_after=after))
    return evs


@pytest.mark.asyncio
async def test_a_reply_that_switches_from_ssd_to_sd_says_so_everywhere(tmp_path):
    """Status line, panel and saved metrics name the mode that produced the reply, not the one configured."""
    history = History(tmp_path / "h.db")
    app = ChatApp(FakeBackend([switched_events(WORDS, 2)]), history=history)
    async with ready(app, size=(140, 45)) as pilot:
        assert app.sub_title.startswith("SSD ·")
        await app.chat_view.submit("hi")
        await wait_until(pilot, lambda: app.chat_view.current is not None and app.chat_view.current.finished)
        assert app.sub_title.startswith("SSD → SD after round 2 ·")
        assert "SSD → SD after round 2" in plain(app.chat_view.panel.query_one("#setup"))
        assert "ssd → sd after round 2" in app.query_one(AssistantMessage)._meta_text
        # the reply's notice sits above the reply (below its prompt), not under the text that streams on
        order = [type(w).__name__ for w in app.chat_view.chat.children if type(w).__name__ in ("UserMessage", "Notice", "AssistantMessage")]
        assert order[-3:] == ["UserMessage", "Notice", "AssistantMessage"], order
    msgs = History(tmp_path / "h.db").messages(History(tmp_path / "h.db").list_conversations()[0].id)
    assert msgs[1].metrics["ran_as"] == "sd" and msgs[1].metrics["switched_after"] == 2
