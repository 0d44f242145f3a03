"""Sending a prompt and showing its reply: :class:`Replies`, the part of the chat that owns a turn.

The reply runs in a thread worker over the chat's :class:`~ssd_chat.chat.session.Session`, which keeps the
conversation; the worker only queues events (:attr:`Replies.inbox`).  Tokens and rounds wait there for
the 10 Hz frame timer, so hundreds of tokens per second cost ~10 Markdown appends per second and no
wake-up of the UI's event loop each; any other event (a notice, the end) wakes it at once.  The turn's
end (Done or Error) is queued after the session has taken the turn into its history.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from textual.message import Message

from ..engine import threads, Done, Error, Event, Notice, Round, Token, Metrics, SamplingParams
from ..history.store import LEAF, metrics_line
from ..chat.session import Session
from ..chat.backend import readable, sampling_of
from .widgets.chat_log import AssistantMessage
from .widgets.figures import baseline_from_reply, ran_as

SAVE_EVERY_S = 1.0  # a streaming reply is saved this often (a crash keeps what streamed)
PANEL_S = 0.5  # the panel and the cache view while a reply streams: a Rich table each, drawn twice a second
# While a reply streams, the app draws at most this share of one core.  The decoder fills the cores, so
# drawing time is taken from it (a frame that delays one of its threads delays the whole step): frames
# come every FRAME_S where they are cheap, less often where they are not (MAX_FRAME_S apart at most).
FRAME_S = 0.1  # screen updates while streaming: 10 per second at most (UI_SHARE)
UI_SHARE = 0.02
MAX_FRAME_S = 0.5


async def settle(worker: Any, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for a worker (None: none) to end; True while it still runs."""
    if worker is not None and worker.is_running:
        with contextlib.suppress(Exception):  # a timeout, or the worker failed (it has ended then)
            await asyncio.wait_for(worker.wait(), timeout_s)
    return worker is not None and worker.is_running


@dataclass
class ReplyEvent(Message, bubble=False):
    """An engine event of reply ``turn`` (-1: a warning from loading), posted by a worker thread."""

    turn: int
    event: Event


@dataclass
class Turn:
    """One prompt and its streaming reply."""

    index: int
    prompt: str
    stop: threading.Event
    widget: AssistantMessage
    message_id: int | None
    metrics: Metrics
    pending: list[Event] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    status: str = "streaming"
    last_save: float = 0.0
    last_panel: float = 0.0
    panel_behind: bool = False  # events applied that the panel does not show yet
    ui_clock: tuple[float, float] = (0.0, 0.0)  # (wall, process CPU) at the last frame
    last_t_s: float = 0.0
    rounds: list[tuple[Round, str | None]] = field(default_factory=list)  # not yet in the panel


@dataclass
class Branch:
    """Where a re-run prompt goes in the saved chat's tree (:mod:`.rerun`): after ``parent``, or, given
    ``user`` (the question's widget, kept on screen), a new reply to that saved question."""

    parent: Any = LEAF
    user: Any = None
    regenerated: bool = False  # F5: the saved question again, so files staged with /attach wait for the next message


class Replies:
    """A prompt and its reply, from the box to the saved message; ``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.inbox: collections.deque[tuple[int, Event]] = collections.deque()  # (turn, event) from the reply's worker
        self.worker: Any = None
        self.frames: Any = None  # the frame timer: runs only while a reply streams (ChatView.on_mount)
        self.token_text: dict[int, str] = {}
        self.seen_ids: set[int] = set()
        self.turn_count = 0
        self._flush_lock = asyncio.Lock()

    # -- sending -------------------------------------------------------------------------
    async def send(self, text: str, branch: Branch | None = None) -> None:
        c, v = self.ctl, self.view
        if not c.ready:
            if c.load_error:
                await v.chat.add_notice(c.load_error, "warning")
            else:  # a toast: a line in the chat would outlast the load it is about
                v.app.notify("the model is still loading; your prompt stays in the box", severity="warning")
            return
        if c.streaming():
            v.app.notify("a reply is still streaming — Esc stops it", severity="warning")
            return
        if c.switching is not None:
            await v.chat.add_notice(f"still switching to {c.switching}; your prompt stays in the box", "warning")
            return
        if await settle(self.worker, 10):  # the engine checks the stop flag every step: this is short
            await v.chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
            return
        try:
            params = SamplingParams(**{**c.backend.sampling_defaults(), **c.params})  # the model's where unset
        except ValueError as e:
            await v.chat.add_notice(str(e), "error")
            return
        v.prompt.remember(text)
        v.prompt.set_text("")
        branch = branch or Branch()
        typed, text = text, (text if branch.regenerated else c.attach.take(text))
        question = branch.user or await v.chat.add_user(text)
        widget = await v.chat.add_assistant(colour=c.colour)
        v.chat.anchor()
        if c.conversation_id is None:  # saved with the system prompts set before its first prompt
            c.conversation_id = c.history.new_conversation(typed)
            for m in c.session.messages:
                c.history.add_message(c.conversation_id, m["role"], m["content"])
        if branch.user is None:
            question.message_id = c.history.add_message(c.conversation_id, "user", text, parent=branch.parent)
        after = LEAF if question.message_id is None else question.message_id
        widget.message_id = mid = c.history.add_message(c.conversation_id, "assistant", "", status="streaming", parent=after)
        await c.branches.show()
        await c.check_history()
        info = c.backend.info()
        turn = Turn(self.turn_count, text, threading.Event(), widget, mid, Metrics(info.get("mode") or "?"))
        self.turn_count += 1
        c.current = turn
        v.prompt.add_class("-busy")
        self.frames.resume()
        c.update_info()
        v.panel.show(None, live=True)
        v.cache.new_reply()
        if c.recorder is not None:
            c.recorder.turn(text, c.system, {**info, **c.params, **sampling_of(params)})  # a replay shows them
        run = functools.partial(self.run_reply, turn.index, c.session, text, params, turn.stop)
        self.worker = v.run_worker(run, group="reply", exit_on_error=False, thread=True)

    def run_reply(self, turn: int, session: Session, text: str, params: SamplingParams, stop: threading.Event) -> None:
        """The engine loop (a thread worker): iterate the session's reply and post each event to the UI.  The end
        (Done or Error) is posted once the stream is over, so the session already holds the turn when the app shows its end."""
        threads.worker(threads.count())
        end: Done | Error | None = None
        try:
            for ev in session.stream(text, params, stop):
                if isinstance(ev, (Done, Error)):
                    end = ev
                else:
                    self._emit(turn, ev)
        except BaseException as e:  # noqa: BLE001 - becomes an Error event, with the partial text kept
            end = end or Error(readable(e), "runtime")
        if end is not None:
            self._emit(turn, end)

    def _emit(self, turn: int, ev: Event) -> None:
        if self.ctl.recorder is not None:
            self.ctl.recorder.event(ev)
        self.inbox.append((turn, ev))  # a deque: appended here, drained on the UI's loop, in order
        if not isinstance(ev, (Token, Round)):
            self.view.post_message(ReplyEvent(turn, ev))

    # -- receiving -----------------------------------------------------------------------
    async def on_event(self, msg: ReplyEvent) -> None:
        if msg.turn == -1 and isinstance(msg.event, Notice):  # not part of a reply
            await self.ctl.warn(msg.event.message)
            return
        await self._receive()
        t = self.ctl.current
        if t is not None and t.pending and isinstance(t.pending[-1], (Done, Error)):
            await self.flush_pending()

    async def _receive(self) -> None:
        """Move the inbox's events, in order, to the current turn's pending list (another turn's, left by a
        reply stopped with Esc, go)."""
        t = self.ctl.current
        while self.inbox:
            turn, ev = self.inbox.popleft()
            if t is None or turn != t.index or self.ctl.quitting:
                continue
            if t.status != "streaming":  # stopped with Esc: only the final text matters (Done.text is authoritative)
                if isinstance(ev, (Done, Error)) and ev.text.startswith(t.text) and len(ev.text) > len(t.text):
                    t.text = ev.text
                    await t.widget.finish(ev.text, t.status, t.widget._meta_text)
                    self.ctl.history.update_message(t.message_id, ev.text, t.status)
                continue
            t.pending.append(ev)

    async def flush_pending(self) -> None:
        """Apply pending events to the screen (from the frame timer, and at once for a notice or the end).

        Textual runs an interval's callback in the timer's own task, so the frame timer and the handler
        of the final event could otherwise interleave at an await: a frame still writing its tokens
        while the reply is finished, then saving the message back as "streaming".  One at a time.
        """
        async with self._flush_lock:
            await self._receive()
            await self.apply_pending()

    async def frame(self) -> None:
        """The frame timer's tick: draw, unless the app's CPU time since the last frame is over UI_SHARE of the time since."""
        t = self.ctl.current
        if t is None:
            return
        now, cpu = time.monotonic(), time.process_time()
        since, used = now - t.ui_clock[0], cpu - t.ui_clock[1]
        if t.ui_clock[0] and since < min(MAX_FRAME_S, used / UI_SHARE):
            return
        t.ui_clock = (now, cpu)
        await self.flush_pending()

    async def apply_pending(self) -> None:
        c, v, t = self.ctl, self.view, self.ctl.current
        if t is None or t.status != "streaming":
            return
        now = time.monotonic()
        if not t.pending:  # a pause in the stream: the panel catches up with what was applied
            if t.panel_behind and now - t.last_panel >= PANEL_S:
                self._show_panel(t, now)
            return
        await c.check_recorder()
        events, t.pending = t.pending, []
        pieces: list[tuple[str, str]] = []
        notices: list[Notice] = []
        end: Done | Error | None = None
        for ev in events:
            if isinstance(ev, (Done, Error)):
                end = ev
                continue
            t.metrics.add(ev)  # a Notice too: a switch of mode (SSD without its speculator) is part of the reply's stats
            if isinstance(ev, Token):
                pieces.append((ev.text, ev.source))
                if ev.text:
                    self.token_text[ev.id] = ev.text
                t.last_t_s = ev.t_s
            elif isinstance(ev, Round):
                t.rounds.append((ev, self.token_text.get(ev.bonus_id) if ev.bonus_id is not None else None))
                self.seen_ids.update(i for _, cands in (ev.predicted or ()) for i in cands)
                if ev.bonus_id is not None:
                    self.seen_ids.add(ev.bonus_id)
                t.last_t_s = max(t.last_t_s, ev.t_s)
            else:
                notices.append(ev)
        # The panel and the cache view are updated before the first await, so no other task ever sees
        # them half way through a batch; while the reply streams, at most every PANEL_S (the end shows
        # its own figures, and _finish its rounds).
        if end is None:
            if now - t.last_panel >= PANEL_S:
                self._show_panel(t, now)
            else:
                t.panel_behind = True
        for ev in notices:  # above the reply: a notice ("compiling ... in the background") is about the reply's work
            if ev.mode is not None:
                c.update_info(t.metrics.label)
            await v.chat.add_notice(ev.message, ev.level, before=t.widget)
        if pieces:
            await t.widget.append(pieces)
            t.text = t.widget.text
        if end is None:
            if now - t.last_save >= SAVE_EVERY_S:
                t.last_save = now
                c.history.update_message(t.message_id, t.text, "streaming")
        elif isinstance(end, Done):
            status = "done" if end.reason in ("eos", "stop", "length") else "stopped"
            v.panel.show(end.stats, live=False)
            if status == "done" and (b := baseline_from_reply(end.stats, f"{ran_as(end.stats).upper()} reply {t.index + 1} in this chat")):
                v.panel.set_measured(b)  # later replies in another mode are measured against it
            info = c.backend.info()
            c.history.save_metrics(t.message_id, end.stats, info.get("target"), info.get("draft"))
            if info.get("compiling") or v.panel.info.get("compiling") or info.get("forward") != v.panel.info.get("forward"):
                c.update_info()  # the path this reply ran, and how far a background compile is
            meta = metrics_line(dataclasses.asdict(end.stats)) + ("" if status == "done" else f" · {status}")
            await self._finish(t, end.text, status, meta)
        else:
            v.panel.show(t.metrics.stats(t.last_t_s), live=False)
            await v.chat.add_notice(f"the reply failed: {end.message} (what streamed is kept)", "error")
            await self._finish(t, end.text or t.text, "error", f"error: {end.message}")

    def _show_panel(self, t: Turn, now: float) -> None:
        t.last_panel, t.panel_behind = now, False
        self._push_rounds(t)
        self.view.panel.show(t.metrics.stats(t.last_t_s), live=True)

    def _push_rounds(self, t: Turn) -> None:
        if t.rounds:
            self.view.panel.add_rounds([r for r, _ in t.rounds])
            self.view.cache.add_rounds(t.rounds)
            t.rounds.clear()

    async def _finish(self, t: Turn, text: str, status: str, meta: str) -> None:
        """The reply is over (done, stopped or failed): keep it everywhere.  ``finished`` is set last."""
        self._push_rounds(t)
        t.status, t.text = status, text
        self.ctl.history.update_message(t.message_id, text, status)
        await t.widget.finish(text, status, meta)
        self.view.prompt.remove_class("-busy")
        self.frames.pause()
        await self.ctl.check_history()
        await self.ctl.check_recorder()
        t.finished = True
        if self.ctl.script and not self.ctl.quitting:
            self.type_next_prompt()

    async def stop(self) -> None:
        """Esc on a streaming reply: stop it now; keep what streamed, and put the prompt back in the box."""
        t = self.ctl.current
        if t is None or t.status != "streaming":
            return
        t.stop.set()
        self.ctl.script.clear()
        await self._receive()
        done = next((e for e in t.pending if isinstance(e, (Done, Error))), None)
        t.pending = [e for e in t.pending if not isinstance(e, (Done, Error))]
        await self.flush_pending()
        if t.status != "streaming":  # its last event came while the tokens were drawn: it ended there, as done
            return
        if done is not None:  # it had already finished: let it end normally
            t.pending = [done]
            await self.flush_pending()
            return
        stats = t.metrics.stats(t.last_t_s)
        self.view.panel.show(stats, live=False)
        await self._finish(t, t.text, "stopped", metrics_line(dataclasses.asdict(stats)) + " · stopped (Esc)")
        if not self.view.prompt.text.strip():
            self.view.prompt.set_text(t.prompt)

    # -- the demo: prompts that type themselves ------------------------------------------
    def type_next_prompt(self) -> None:
        self.view.run_worker(self._type_next(), group="typing", exclusive=True)

    async def _type_next(self) -> None:
        c = self.ctl
        if not c.script or c.quitting:
            return
        text = c.script.pop(0)
        await asyncio.sleep(0.4)
        for n in range(1, len(text) + 1):
            if c.quitting or c.streaming():
                return
            self.view.prompt.set_text(text[:n])
            await asyncio.sleep(c.type_delay_s)
        await asyncio.sleep(0.2)
        await c.submit(text)
        if text.startswith("/") and c.script:  # commands produce no reply: go on
            self.type_next_prompt()
