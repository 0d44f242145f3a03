"""Pilot tests: regenerate, edit and re-run, the first-screen hint, the settings dialog's sampling fields,
and deleting a saved chat after a confirmation (scripted streams, no model)."""

from __future__ import annotations

import pytest
from helpers.tui import (after_chat, chat, FakeBackend, laid_out, notices, on_screen, press_for_reply,
                          ready, saved, scripted_app, ssd_events, wait_until)
from textual.widgets import Input

from ssd_chat.engine import SamplingParams
from ssd_chat.history.store import History
from ssd_chat.tui.app import ChatApp
from ssd_chat.chat.changes import FIELDS, parse_settings
from ssd_chat.tui.widgets.chat_log import AssistantMessage, UserMessage
from ssd_chat.tui.widgets.confirm_dialog import ConfirmDialog
from ssd_chat.tui.widgets.settings_dialog import SettingsDialog


class TestRegenerate:
    @pytest.mark.asyncio
    async def test_f5_drops_the_last_reply_and_decodes_it_again_with_the_current_settings(self, tmp_path):
        async with after_chat(tmp_path / "h.db", ("one", "two", "again"), ("a", "b"), size=(140, 45)) as (app, backend, pilot):
            await app.chat_view.submit("/temp 0.7")
            app.chat_view.prompt.set_text("half typed")
            await press_for_reply(pilot, app, "f5", 3)
            # the model saw the chat without the dropped reply, and the temperature set after it
            assert backend.calls[2] == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "one"},
                                        {"role": "user", "content": "b"}]
            assert app.chat_view.params["temperature"] == 0.7
            want = [("user", "a"), ("assistant", "one"), ("user", "b"), ("assistant", "again")]
            assert app.chat_view.messages == [{"role": r, "content": c} for r, c in want]
            assert on_screen(app) == want
            assert any("from the next reply: temperature 0.7" in n for n in notices(app))  # later notices stay
            assert app.chat_view.prompt.text == "half typed"  # what was being typed stays in the box
        assert saved(tmp_path / "h.db") == [("a", want)]

    @pytest.mark.asyncio
    async def test_regenerate_command_and_palette_entry_and_nothing_to_regenerate(self, tmp_path):
        app, backend = scripted_app(tmp_path / "h.db", "one", "two", "three")
        async with ready(app, size=(140, 45)) as pilot:
            await app.chat_view.submit("/regen")
            assert any("no reply to regenerate yet" in n for n in notices(app)) and backend.calls == []
            await chat(app, pilot, "a")
            await app.chat_view.submit("/regenerate")
            await wait_until(pilot, lambda: len(backend.calls) == 2 and app.chat_view.current.finished)
            cmd = next(c for c in app.get_system_commands(app.screen) if c.title == "Regenerate last reply")
            await cmd.callback()
            await wait_until(pilot, lambda: len(backend.calls) == 3 and app.chat_view.current.finished)
            assert on_screen(app) == [("user", "a"), ("assistant", "three")]
        assert saved(tmp_path / "h.db") == [("a", [("user", "a"), ("assistant", "three")])]

    @pytest.mark.asyncio
    async def test_regenerate_after_esc_waits_for_the_stopped_reply(self, tmp_path):
        """The stopped reply enters the session when its thread ends: regenerate must cut after that, not before."""
        backend = FakeBackend([ssd_events(["long", " reply", " here", " and", " more"]), ssd_events(["fresh"])], block=True)
        app = ChatApp(backend, history=History(tmp_path / "h.db"))
        async with ready(app, size=(140, 45)) as pilot:
            await app.chat_view.submit("a")
            await wait_until(pilot, lambda: backend.blocked.is_set())
            await pilot.press("f5")  # refused while it streams
            assert len(backend.calls) == 1 and app.chat_view.current.status == "streaming"
            await pilot.press("escape")
            await press_for_reply(pilot, app, "f5", 2)
            assert app.chat_view.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "fresh"}]
            assert on_screen(app) == [("user", "a"), ("assistant", "fresh")]
        assert saved(tmp_path / "h.db") == [("a", [("user", "a"), ("assistant", "fresh")])]


class TestEdit:
    @pytest.mark.asyncio
    async def test_edit_an_earlier_message_reruns_from_it_and_keeps_the_old_branch(self, tmp_path):
        async with after_chat(tmp_path / "h.db", ("one", "two", "three", "new"), ("first", "second", "third"),
                              size=(140, 45)) as (app, backend, pilot):
            before = [("user", "first"), ("assistant", "one"), ("user", "second"), ("assistant", "two"),
                      ("user", "third"), ("assistant", "three")]
            await wait_until(pilot, lambda: laid_out(app) and len(app.chat_view.messages) == 6)
            app.chat_view.prompt.focus()
            await wait_until(pilot, lambda: app.focused is app.chat_view.prompt)
            # from the prompt box: the last reply, the message it answered, then the ones before
            for kind, text in ((AssistantMessage, "three"), (UserMessage, "third"), (AssistantMessage, "two"), (UserMessage, "second")):
                await pilot.press("shift+tab")
                await wait_until(pilot, lambda: isinstance(app.focused, kind) and app.focused.text == text)
            await pilot.press("e")
            assert app.chat_view.prompt.text == "second" and app.focused is app.chat_view.prompt
            assert "editing your message 2 of 3" in str(app.chat_view.prompt.border_title)
            assert on_screen(app) == before  # nothing is cut before it is sent
            app.chat_view.prompt.set_text("second, edited")
            await press_for_reply(pilot, app, "enter", 4)
            assert backend.calls[3] == [{"role": "user", "content": "first"}, {"role": "assistant", "content": "one"},
                                        {"role": "user", "content": "second, edited"}]
            after = [("user", "first"), ("assistant", "one"), ("user", "second, edited"), ("assistant", "new")]
            assert on_screen(app) == after
            assert app.chat_view.messages == [{"role": r, "content": c} for r, c in after]
            assert app.chat_view.controller.rerun.editing is None and not app.chat_view.prompt.border_title
            said = [n for n in notices(app) if "stays as a branch" in n]
            assert said and "re-running from your message 2" in said[0]
            assert [w.branch for w in app.chat_view.chat.query(UserMessage)] == ["", "‹ 2/2 ›"]
        assert saved(tmp_path / "h.db") == [("first", after)]  # one chat, whose current branch is the edited one
        assert saved(tmp_path / "h.db", all_branches=True) == [("first", before[:3] + before[3:] + after[2:])]

    @pytest.mark.asyncio
    async def test_a_message_is_in_the_focus_chain_in_its_place_before_its_first_layout(self, tmp_path):
        """Shift+Tab right after a reply ended: the reply is the first stop even if no frame has laid it out
        yet (Textual orders focusable siblings by where they are, and an unlaid-out widget is at the top)."""
        async with after_chat(tmp_path / "h.db", ("one",), ("first",), size=(140, 45)) as (app, backend, pilot):
            await wait_until(pilot, lambda: laid_out(app))
            log = app.chat_view.chat
            user, reply = await log.add_user("second"), await log.add_assistant("two", status="done")
            assert reply.virtual_region.y == 0  # not laid out yet: the case this test is about
            chain = [w for w in app.screen.focus_chain if isinstance(w, (UserMessage, AssistantMessage))]
            assert chain[-2:] == [user, reply] and laid_out(app)

    @pytest.mark.asyncio
    async def test_an_edit_while_another_program_holds_the_lock_saves_its_branch_once_the_lock_goes(self, tmp_path):
        """The branch is made in memory while the file is locked and saved once the lock goes, in the same
        chat, beside the message it replaces."""
        import sqlite3

        path = tmp_path / "h.db"
        backend = FakeBackend([ssd_events(["one"]), ssd_events(["two"]), ssd_events(["again"])])
        app = ChatApp(backend, history=History(path, timeout_s=0.1))
        other = sqlite3.connect(path, timeout=0.1)
        try:
            async with ready(app, size=(140, 45)) as pilot:
                await chat(app, pilot, "first")
                await pilot.press("ctrl+n")
                await chat(app, pilot, "second")
                assert app.chat_view.conversation_id == 2
                other.execute("BEGIN EXCLUSIVE")  # another program mid-transaction: writes wait in memory
                await app.chat_view.submit("/edit 1")
                app.chat_view.prompt.set_text("second, edited")
                await press_for_reply(pilot, app, "enter", 3)
                assert any("stays as a branch" in n for n in notices(app)), notices(app)
                assert any("another program has it locked" in n for n in notices(app)), notices(app)
                other.rollback()  # the lock goes: what was held back is saved, in order
                await pilot.press("ctrl+c")
        finally:
            other.close()
        h = History(path)
        assert [(c.id, c.title) for c in sorted(h.list_conversations(), key=lambda c: c.id)] == [(1, "first"), (2, "second, edited")]
        assert [(m.role, m.content) for m in h.messages(2)] == [("user", "second, edited"), ("assistant", "again")]
        assert [(m.role, m.content) for m in h.messages(2, all_branches=True)] == [
            ("user", "second"), ("assistant", "two"), ("user", "second, edited"), ("assistant", "again")]
        h.close()

    @pytest.mark.asyncio
    async def test_edit_command_the_first_message_renames_the_chat_and_esc_cancels(self, tmp_path):
        async with after_chat(tmp_path / "h.db", ("one", "two", "renamed"), ("first", "second"), size=(140, 45)) as (app, backend, pilot):
            for bad in ("/edit 0", "/edit x", "/edit 3"):
                await app.chat_view.submit(bad)
            assert any("usage: /edit [N]" in n for n in notices(app))
            assert any("no message 3: this chat has 2 of yours" in n for n in notices(app))
            await app.chat_view.submit("/edit")  # the last message
            assert app.chat_view.prompt.text == "second" and app.chat_view.controller.rerun.editing.index == 1
            await pilot.press("escape")
            assert app.chat_view.controller.rerun.editing is None and app.chat_view.prompt.text == "" and len(backend.calls) == 2
            app.chat_view.prompt.set_text("my draft")
            await next(c for c in app.get_system_commands(app.screen) if c.title == "Edit your last message").callback()
            assert app.chat_view.prompt.text == "second"
            await pilot.press("escape")  # the box gets back what was being typed
            assert app.chat_view.controller.rerun.editing is None and app.chat_view.prompt.text == "my draft" and len(backend.calls) == 2
            await app.chat_view.submit("/edit 1")
            app.chat_view.prompt.set_text("a new first")
            await press_for_reply(pilot, app, "enter", 3)
            assert backend.calls[2] == [{"role": "user", "content": "a new first"}]
            assert on_screen(app) == [("user", "a new first"), ("assistant", "renamed")]
        chats = saved(tmp_path / "h.db")
        assert chats == [("a new first", [("user", "a new first"), ("assistant", "renamed")])]
        assert saved(tmp_path / "h.db", all_branches=True)[0][1] == [
            ("user", "first"), ("assistant", "one"), ("user", "second"), ("assistant", "two"), ("user", "a new first"), ("assistant", "renamed")]

    @pytest.mark.asyncio
    async def test_an_edit_left_open_ends_with_a_new_chat(self, tmp_path):
        async with after_chat(tmp_path / "h.db", ("one", "fresh"), ("first",), size=(140, 45)) as (app, backend, pilot):
            cmd = next(c for c in app.get_system_commands(app.screen) if c.title == "Edit your last message")
            await cmd.callback()
            assert app.chat_view.controller.rerun.editing is not None and app.chat_view.prompt.text == "first"
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: app.chat_view.controller.rerun.editing is None and not app.query(UserMessage))
            await chat(app, pilot, "elsewhere")
            assert backend.calls[1] == [{"role": "user", "content": "elsewhere"}]
        assert [t for t, _ in saved(tmp_path / "h.db")] == ["elsewhere", "first"]


class TestHint:
    @pytest.mark.asyncio
    async def test_an_empty_chat_names_help_the_palette_and_the_send_key(self):
        app = ChatApp(FakeBackend([ssd_events(["one"])]))
        async with ready(app, size=(140, 45)) as pilot:
            [hint] = app.query(".hint")
            assert "/help" in hint.content and "Ctrl+P" in hint.content and "Enter to send" in hint.content
            await chat(app, pilot, "hi")
            assert not app.query(".hint")
            await pilot.press("ctrl+n")
            await wait_until(pilot, lambda: len(app.query(".hint")) == 1)


class TestSettingsFields:
    @pytest.mark.asyncio
    async def test_top_p_top_k_seed_apply_and_bad_values_keep_the_dialog_open(self):
        backend = FakeBackend([ssd_events(["one"])])
        app = ChatApp(backend, settings={"sampling": SamplingParams.given({"temperature": 0.8})})
        async with ready(app, size=(140, 45)) as pilot:
            await pilot.press("ctrl+o")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
            field = {key: app.screen.query_one(f"#{key}", Input) for key in FIELDS}
            assert field["fan_out"].value == "geometric"  # the fan-out in use, not an empty field
            assert (field["top_p"].value, field["top_k"].value, field["seed"].value) == ("1.0", "0", "")
            for key, bad, words in (("top_p", "1.5", "top-p must be in (0, 1], got 1.5"),
                                    ("top_p", "nan", "top-p must be a finite number, got 'nan'"),
                                    ("top_k", "-3", "top-k must be >= 0"), ("top_k", "2.5", "top-k must be a whole number"),
                                    ("seed", "-1", "seed must be a whole number from 0 to"), ("seed", str(2**70), "seed must be a whole number from 0 to"),
                                    ("repetition_penalty", "0", "repetition"), ("repetition_penalty", "inf", "finite"),
                                    ("fan_out", "9,9", "fan-out list '9,9' has 2 entries but k=3 needs")):
                field[key].value = bad
                field[key].focus()
                await pilot.press("enter")  # Enter in a field applies
                await pilot.pause()
                assert isinstance(app.screen, SettingsDialog)
                assert words in str(app.screen.query_one("#settings-error").content), (key, bad)
                field[key].value = {"fan_out": "geometric", "top_p": "1.0", "top_k": "0", "seed": "",
                                    "repetition_penalty": "1.0"}[key]
            field["top_p"].value, field["top_k"].value, field["seed"].value = "0.9", "40", "7"
            field["repetition_penalty"].value = "1.2"
            await pilot.click("#apply")
            await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
            assert app.chat_view.params == {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 7, "repetition_penalty": 1.2}
            assert backend.info_.get("fan_out") is None  # untouched fields are not re-applied
            await chat(app, pilot, "hi")
            await pilot.press("ctrl+o")
            await wait_until(pilot, lambda: isinstance(app.screen, SettingsDialog))
            assert app.screen.query_one("#seed", Input).value == "7"
            app.screen.query_one("#seed", Input).value = ""  # empty: a new seed each reply
            await pilot.click("#apply")
            await wait_until(pilot, lambda: not isinstance(app.screen, SettingsDialog))
            assert app.chat_view.params["seed"] is None

    def test_slash_commands_for_sampling_and_one_table_for_the_fields(self):
        assert parse_settings({"top_p": "0.5", "top_k": "4", "seed": "3"}) == {"top_p": 0.5, "top_k": 4, "seed": 3}
        assert parse_settings({"repetition_penalty": "1.1"}) == {"repetition_penalty": 1.1}
        with pytest.raises(ValueError, match="temperature must be a finite number, got 'inf'"):
            parse_settings({"temperature": "inf"})
        assert list(FIELDS)[:2] == ["k", "fan_out"] and {"top_p", "top_k", "seed"} <= set(FIELDS)


class TestDeleteChat:
    @pytest.mark.asyncio
    async def test_d_asks_naming_the_chat_n_and_esc_keep_it_y_and_enter_delete(self, tmp_path):
        h = History(tmp_path / "h.db")
        ids = []
        for title, n in (("first chat", 2), ("second chat", 1), ("third chat", 3)):
            cid = h.new_conversation(title)
            for i in range(n):
                h.add_message(cid, "user" if i % 2 == 0 else "assistant", f"{title} {i}")
            ids.append(cid)
        app = ChatApp(FakeBackend([]), history=h)
        async with ready(app, size=(140, 45)) as pilot:
            await pilot.press("ctrl+r")
            await wait_until(pilot, lambda: app.screen.query("#chat-list"))
            ol = app.screen.query_one("#chat-list")

            def pick(cid: int) -> None:
                ol.highlighted = [ol.get_option_at_index(i).id for i in range(ol.option_count)].index(str(cid))

            pick(ids[2])
            for cancel in ("n", "escape"):
                await pilot.press("d")
                await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
                question = str(app.screen.query_one("#confirm-question").content)
                assert f"Delete chat {ids[2]}, “third chat” (3 messages)?" in question
                await pilot.press(cancel)
                await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmDialog))
                assert h.get_conversation(ids[2]) is not None and ol.option_count == 3
            await pilot.press("d", "d")  # the old "d d" no longer deletes by itself
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            assert h.get_conversation(ids[2]) is not None
            await pilot.press("y")
            await wait_until(pilot, lambda: ol.option_count == 2)
            assert h.get_conversation(ids[2]) is None
            pick(ids[1])
            await pilot.press("delete")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            assert "“second chat” (1 message)?" in str(app.screen.query_one("#confirm-question").content)
            await pilot.press("enter")
            await wait_until(pilot, lambda: ol.option_count == 1)
            assert [c.id for c in h.list_conversations()] == [ids[0]]

    @pytest.mark.asyncio
    async def test_deleting_the_open_chat_goes_on_in_a_new_saved_chat(self, tmp_path):
        """Once the open chat was deleted, its next message had no chat to go to: the failed write put the
        whole history in memory for the rest of the session."""
        async with after_chat(tmp_path / "h.db", ("one", "two"), ("doomed",), size=(140, 45)) as (app, backend, pilot):
            await pilot.press("ctrl+r")
            await wait_until(pilot, lambda: app.screen.query("#chat-list"))
            await pilot.press("d")
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmDialog))
            await pilot.press("y")
            await pilot.press("escape")
            await wait_until(pilot, lambda: app.chat_view.conversation_id is None and not app.query(UserMessage))
            await chat(app, pilot, "next")
            assert app.history.warning is None
        assert saved(tmp_path / "h.db") == [("next", [("user", "next"), ("assistant", "two")])]


class TestSavedChats:
    @pytest.mark.asyncio
    async def test_regenerate_in_a_resumed_chat(self, tmp_path):
        h = History(tmp_path / "h.db")
        cid = h.new_conversation("old question")
        for role, text in (("user", "old question"), ("assistant", "old answer"), ("user", "more"), ("assistant", "stale")):
            h.add_message(cid, role, text)
        backend = FakeBackend([ssd_events(["fresh"])])
        app = ChatApp(backend, history=h, resume=cid)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_until(pilot, lambda: app.chat_view.ready and len(app.chat_view.messages) == 4)
            assert not app.query(".hint")
            await press_for_reply(pilot, app, "f5", 1)
            assert backend.calls[0][-1] == {"role": "user", "content": "more"}
        assert saved(tmp_path / "h.db") == [("old question", [("user", "old question"), ("assistant", "old answer"),
                                                              ("user", "more"), ("assistant", "fresh")])]

    @pytest.mark.asyncio
    async def test_regenerate_in_a_saved_chat_that_lost_a_write_loses_nothing_more(self, tmp_path):
        """When the saved chat does not hold what the screen shows, regenerate still deletes nothing: the new
        reply goes beside the old one."""
        async with after_chat(tmp_path / "h.db", ("one", "two", "again"), ("a", "b"), size=(140, 45)) as (app, backend, pilot):
            app.history.db.execute("DELETE FROM messages WHERE content='one'")  # a write the file never got
            app.history.db.commit()
            await press_for_reply(pilot, app, "f5", 3)
        assert saved(tmp_path / "h.db", all_branches=True) == [
            ("a", [("user", "a"), ("user", "b"), ("assistant", "two"), ("assistant", "again")])]
