"""The chat app: transcript + prompt on the left, live speculation panel and cache view on the right.

Engine work runs in thread workers that only post messages; handlers here touch the widgets.
Token text is coalesced and written to the screen by a 20 Hz timer, so hundreds of tokens per
second cost ~20 Markdown appends per second.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Static

from ..engine.events import Done, Error, Event, Notice, Round, Token
from ..engine.metrics import Metrics
from ..engine.params import SamplingParams
from ..history import History, metrics_line
from ..terminal import printable
from .actions import SAMPLING_KEYS, ChatActions
from .backend import Backend, readable
from .comparing import CompareActions
from .figures import Baseline, baseline_from_reply, ran_as
from .widgets.cache_view import CacheView
from .widgets.chat_log import AssistantMessage, ChatLog
from .widgets.load_status import LoadStatus
from .widgets.metrics_panel import MetricsPanel
from .widgets.prompt_input import PromptInput

FRAME_S = 0.05  # screen updates while streaming: 20 per second
SAVE_EVERY_S = 1.0  # a streaming reply is saved this often (a crash keeps what streamed)

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
    last_t_s: float = 0.0


class ChatApp(CompareActions, ChatActions, App[int]):
    CSS_PATH = "app.tcss"
    TITLE = "ssd-chat"
    BINDINGS = [
        Binding("ctrl+c", "quit", "Quit", priority=True),
        Binding("ctrl+q", "quit", "Quit", show=False, priority=True),
        Binding("q", "quit_key", "Quit", show=False),  # only where q is not text (not in the prompt, not in a dialog)
        Binding("escape", "stop", "Stop reply"),
        # priority: the prompt box (a TextArea) has its own ctrl+y etc.; off while a dialog is open
        Binding("ctrl+n", "new_chat", "New chat", priority=True),
        Binding("ctrl+y", "copy_reply", "Copy reply", priority=True),
        Binding("ctrl+s", "system_prompt", "System", priority=True),
        Binding("ctrl+o", "settings", "Settings", priority=True),
        Binding("ctrl+r", "chats", "Chats", priority=True),
        Binding("ctrl+t", "toggle_colour", "Colours", priority=True),
        Binding("ctrl+g", "compare", "AR·SD·SSD", priority=True),
    ]
    MAIN_SCREEN_ACTIONS = {"new_chat", "copy_reply", "system_prompt", "settings", "chats", "toggle_colour", "stop", "quit_key",
                           "compare"}

    class ReplyEvent(Message):
        def __init__(self, turn: int, event: Event) -> None:
            super().__init__()
            self.turn, self.event = turn, event

    class LoadProgress(Message):
        def __init__(self, stage: str, frac: float | None) -> None:
            super().__init__()
            self.stage, self.frac = stage, frac

    class Loaded(Message):
        def __init__(self, error: str | None) -> None:
            super().__init__()
            self.error = error

    def __init__(
        self,
        backend: Backend,
        *,
        settings: dict[str, Any] | None = None,
        history: History | None = None,
        recorder: Any = None,
        resume: int | None = None,
        script: Iterable[str] = (),
        type_delay_s: float = 0.03,
        baselines: Iterable[Baseline] = (),
    ) -> None:
        super().__init__()
        settings = dict(settings or {})
        self.backend = backend
        self.history = history if history is not None else History(None)
        self.recorder = recorder
        self.system: str | None = settings.get("system") or None
        self.params: dict[str, Any] = {k: settings[k] for k in SAMPLING_KEYS if settings.get(k) is not None}
        self.colour = bool(settings.get("colour_tokens"))
        self.messages: list[dict[str, str]] = []
        self.conversation_id: int | None = None
        self.resume_id = resume
        self.script = list(script) or list(backend.scripted_prompts)
        self.type_delay_s = type_delay_s
        self.baselines = list(baselines)
        self.ready = False
        self.load_error: str | None = None
        self.current: Turn | None = None
        self.turn_count = 0
        self.clipboard_text: str | None = None
        self._reply_worker: Any = None
        self.switching: str | None = None  # an engine change in progress ("mode sd"): prompts wait for it
        self._token_text: dict[int, str] = {}
        self._seen_ids: set[int] = set()
        self._quitting = False

    def notify(self, message: str, *, title: str = "", severity: Any = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Plain text unless asked: notifications quote paths, model names and chat titles."""
        super().notify(printable(message), title=title, severity=severity, timeout=timeout, markup=markup)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen):
            return False  # let the dialog have its keys (ctrl+s saves the system prompt there)
        return True

    # -- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        self._chat, self._panel = ChatLog(id="chat"), MetricsPanel(id="panel")
        self._cache, self._prompt = CacheView(id="cache"), PromptInput(id="prompt")
        yield Header(show_clock=False)
        with Vertical(id="main"):
            yield LoadStatus(id="load")
            yield self._chat
            yield self._prompt
        with Vertical(id="side"):
            yield Static("Speculation", classes="side-title")
            yield self._panel
            yield Static("Speculation cache: latest rounds (j: predicted bonus)", classes="side-title")
            yield self._cache
        yield Footer()

    @property
    def chat(self) -> ChatLog:
        return self._chat

    @property
    def panel(self) -> MetricsPanel:
        return self._panel

    @property
    def cache(self) -> CacheView:
        return self._cache

    @property
    def prompt(self) -> PromptInput:
        return self._prompt

    async def on_mount(self) -> None:
        self.sub_title = "loading…"
        for b in self.baselines:
            self.panel.set_measured(b)
        self.cache.token_text = self._lookup_text
        self.prompt.focus()
        self._flush_lock = asyncio.Lock()
        self._frames = self.set_interval(FRAME_S, self._flush_pending, pause=True)  # runs only while a reply streams
        if self.history.warning:
            await self._warn(self.history.warning)
        if self.resume_id is not None:
            await self.resume(self.resume_id)
        self.load_backend()

    # -- loading -------------------------------------------------------------------------
    def load_backend(self) -> None:
        """Load in a daemon thread: quitting during a long load must not wait for it to finish."""
        threading.Thread(target=self._load, name="ssd-chat-load", daemon=True).start()

    def _load(self) -> None:
        # warnings found before loading (a model too large for this machine) reach the chat at once
        self.backend.warn = lambda message: self.post_message(self.ReplyEvent(-1, Notice(message, "warning")))
        try:
            self.backend.load(lambda stage, frac: self.post_message(self.LoadProgress(stage, frac)))
        except BaseException as e:  # noqa: BLE001 - shown in the app, never as a traceback
            self.post_message(self.Loaded(f"could not load the model: {readable(e)}"))
            return
        self.post_message(self.Loaded(None))

    def on_chat_app_load_progress(self, msg: LoadProgress) -> None:
        self.query_one(LoadStatus).set_stage(msg.stage, msg.frac)

    async def on_chat_app_loaded(self, msg: Loaded) -> None:
        load = self.query_one(LoadStatus)
        if msg.error:
            self.load_error = msg.error
            load.fail(msg.error)
            self.sub_title = "load failed"
            await self.chat.add_notice(msg.error + " — press Ctrl+C to quit", "error")
            return
        load.display = False
        self.ready = True
        self._update_info()
        if self.script:
            self.type_next_prompt()

    def _update_info(self) -> None:
        info = dict(self.backend.info())
        info.setdefault("temperature", self.params.get("temperature", 0.0))
        self.panel.set_info(info)
        self.sub_title = printable(f"{(info.get('mode') or '?').upper()} · {info.get('target') or ''}", one_line=True)

    def _show_mode(self, label: str) -> None:
        """The status line and the panel name the mode that is really running this reply."""
        info = dict(self.backend.info())
        info.setdefault("temperature", self.params.get("temperature", 0.0))
        info["mode_label"] = label
        self.panel.set_info(info)
        self.sub_title = f"{label} · {info.get('target') or ''}"

    # -- sending -------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        await self.submit(event.text)

    async def submit(self, text: str) -> None:
        text = text.strip("\n")
        if text.startswith("/"):
            self.prompt.remember(text)
            self.prompt.set_text("")
            await self.command(text)
            return
        if not self.ready:
            await self.chat.add_notice(self.load_error or "the model is still loading; your prompt stays in the box", "warning")
            return
        if self.current is not None and not self.current.finished:
            self.notify("a reply is still streaming — Esc stops it", severity="warning")
            return
        if self.switching is not None:
            await self.chat.add_notice(f"still switching to {self.switching}; your prompt stays in the box", "warning")
            return
        if self._reply_worker is not None and self._reply_worker.is_running:
            try:  # the engine checks the stop flag every step: this is short
                await asyncio.wait_for(self._reply_worker.wait(), 10)
            except Exception:  # noqa: BLE001
                if self._reply_worker.is_running:
                    await self.chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
                    return
        try:
            params = SamplingParams(**self.params)
        except ValueError as e:
            await self.chat.add_notice(str(e), "error")
            return
        self.prompt.remember(text)
        self.prompt.set_text("")
        await self.chat.add_user(text)
        widget = await self.chat.add_assistant(colour=self.colour)
        self.chat.anchor()
        if self.conversation_id is None:
            self.conversation_id = self.history.new_conversation(text, self.system)
        self.history.add_message(self.conversation_id, "user", text)
        mid = self.history.add_message(self.conversation_id, "assistant", "", status="streaming")
        await self._check_history()
        info = self.backend.info()
        turn = Turn(self.turn_count, text, threading.Event(), widget, mid, Metrics(info.get("mode") or "?"))
        self.turn_count += 1
        self.current = turn
        self.prompt.add_class("-busy")
        self._frames.resume()
        self._update_info()
        self.panel.show(None, live=True)
        self.cache.new_reply()
        if self.recorder is not None:
            self.recorder.turn(text, self.system, {**info, **self.params})
        msgs = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages + [
            {"role": "user", "content": text}]
        self._reply_worker = self.run_reply(turn.index, msgs, params, turn.stop)

    @work(thread=True, group="reply", exit_on_error=False)
    def run_reply(self, turn: int, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event) -> None:
        """The engine loop: iterate the event stream and post each event to the UI."""
        try:
            for ev in self.backend.stream(messages, params, stop):
                self._emit(turn, ev)
        except BaseException as e:  # noqa: BLE001 - becomes an Error event, with the partial text kept
            self._emit(turn, Error(readable(e), "runtime"))

    def _emit(self, turn: int, ev: Event) -> None:
        if self.recorder is not None:
            self.recorder.event(ev)
        self.post_message(self.ReplyEvent(turn, ev))

    # -- receiving -----------------------------------------------------------------------
    async def on_chat_app_reply_event(self, msg: ReplyEvent) -> None:
        t = self.current
        ev = msg.event
        if msg.turn == -1 and isinstance(ev, Notice):  # not part of a reply
            await self._warn(ev.message)
            return
        if t is None or msg.turn != t.index:
            return
        if self._quitting:
            return
        if t.status != "streaming":  # stopped with Esc: only the final text matters (Done.text is authoritative)
            if isinstance(ev, (Done, Error)) and ev.text.startswith(t.text) and len(ev.text) > len(t.text):
                t.text = ev.text
                await t.widget.finish(ev.text, t.status, t.widget._meta_text)
                self.history.update_message(t.message_id, ev.text, t.status)
                if self.messages and self.messages[-1]["role"] == "assistant":
                    self.messages[-1]["content"] = ev.text
            return
        t.pending.append(ev)
        if isinstance(ev, (Done, Error)):
            await self._flush_pending()

    async def _flush_pending(self) -> None:
        """Apply pending events to the screen (called 20 times a second and at the end of a reply).

        Textual runs an interval's callback in the timer's own task, so the frame timer and the handler
        of the final event could otherwise interleave at an await: a frame still writing its tokens
        while the reply is finished, then saving the message back as "streaming".  One at a time.
        """
        async with self._flush_lock:
            await self._apply_pending()

    async def _apply_pending(self) -> None:
        t = self.current
        if t is None or t.status != "streaming" or not t.pending:
            return
        await self._check_recorder()
        events, t.pending = t.pending, []
        pieces: list[tuple[str, str]] = []
        rounds: list[tuple[Round, str | None]] = []
        notices: list[Notice] = []
        end: Done | Error | None = None
        for ev in events:
            if isinstance(ev, Token):
                t.metrics.add(ev)
                pieces.append((ev.text, ev.source))
                if ev.text:
                    self._token_text[ev.id] = ev.text
                t.last_t_s = ev.t_s
            elif isinstance(ev, Round):
                t.metrics.add(ev)
                rounds.append((ev, self._token_text.get(ev.bonus_id) if ev.bonus_id is not None else None))
                self._seen_ids.update(c for _, cands in (ev.predicted or ()) for c in cands)
                if ev.bonus_id is not None:
                    self._seen_ids.add(ev.bonus_id)
                t.last_t_s = max(t.last_t_s, ev.t_s)
            elif isinstance(ev, Notice):
                t.metrics.add(ev)  # a switch of mode (SSD without its speculator) is part of the reply's stats
                notices.append(ev)
            elif isinstance(ev, (Done, Error)):
                end = ev
        # The panel and the cache view are updated before the first await, so no other task ever sees
        # metrics that already hold this batch next to a panel that does not.
        if rounds:
            self.panel.add_rounds([r for r, _ in rounds])
            self.cache.add_rounds(rounds)
        if end is None:
            self.panel.show(t.metrics.stats(t.last_t_s), live=True)
        for ev in notices:
            if ev.mode is not None:
                self._show_mode(t.metrics.label)
            await self.chat.add_notice(ev.message, ev.level)
        if pieces:
            await t.widget.append(pieces)
            t.text = t.widget.text
        if end is None:
            now = time.monotonic()
            if now - t.last_save >= SAVE_EVERY_S:
                t.last_save = now
                self.history.update_message(t.message_id, t.text, "streaming")
        elif isinstance(end, Done):
            status = "done" if end.reason in ("eos", "stop", "length") else "stopped"
            self.panel.show(end.stats, live=False)
            if status == "done" and (b := baseline_from_reply(end.stats, f"{ran_as(end.stats).upper()} reply {t.index + 1} in this chat")):
                self.panel.set_measured(b)  # later replies in another mode are measured against it
            info = self.backend.info()
            self.history.save_metrics(t.message_id, end.stats, info.get("target"), info.get("draft"))
            meta = metrics_line(dataclasses.asdict(end.stats)) + ("" if status == "done" else f" · {status}")
            await self._finish(t, end.text, status, meta)
        else:
            self.panel.show(t.metrics.stats(t.last_t_s), live=False)
            await self.chat.add_notice(f"the reply failed: {end.message} (what streamed is kept)", "error")
            await self._finish(t, end.text or t.text, "error", f"error: {end.message}")

    async def _finish(self, t: Turn, text: str, status: str, meta: str) -> None:
        """The reply is over (done, stopped or failed): keep it everywhere.  ``finished`` is set last."""
        t.status, t.text = status, text
        self.messages += [{"role": "user", "content": t.prompt}, {"role": "assistant", "content": text}]
        self.history.update_message(t.message_id, text, status)
        await t.widget.finish(text, status, meta)
        self.prompt.remove_class("-busy")
        self._frames.pause()
        await self._check_history()
        await self._check_recorder()
        t.finished = True
        if self.script and not self._quitting:
            self.type_next_prompt()

    # -- actions -------------------------------------------------------------------------
    async def action_stop(self) -> None:
        """Esc: stop the reply (or the comparison) now; keep what streamed, and put the prompt back in the box."""
        if self._compare_stop is not None:
            self._compare_stop.set()
        t = self.current
        if t is None or t.status != "streaming":
            return
        t.stop.set()
        self.script.clear()
        pending = [e for e in t.pending if not isinstance(e, (Done, Error))]
        done = next((e for e in t.pending if isinstance(e, (Done, Error))), None)
        t.pending = pending
        await self._flush_pending()
        if done is not None:  # it had already finished: let it end normally
            t.pending = [done]
            await self._flush_pending()
            return
        stats = t.metrics.stats(t.last_t_s)
        self.panel.show(stats, live=False)
        await self._finish(t, t.text, "stopped", metrics_line(dataclasses.asdict(stats)) + " · stopped (Esc)")
        if not self.prompt.text.strip():
            self.prompt.set_text(t.prompt)

    async def action_quit_key(self) -> None:
        await self.action_quit()

    async def action_quit(self) -> None:
        """Ctrl+C / q: stop any reply, wait for the engine thread, release models, exit."""
        if self._quitting:
            return
        self._quitting = True
        self.script.clear()
        if self.current is not None and self.current.status == "streaming":
            await self.action_stop()
        w = self._reply_worker
        if w is not None and w.is_running:
            try:
                await asyncio.wait_for(w.wait(), 15)
            except Exception:  # noqa: BLE001
                pass
        await self.stop_compare()
        await self._release()
        self.exit(0)

    async def _release(self) -> None:
        if self.recorder is not None:
            vocab = {i: s for i in sorted(self._seen_ids) if (s := self._lookup_text(i)) is not None}
            if vocab:
                self.recorder.vocab(vocab)
            self.recorder.close()
        try:
            await asyncio.to_thread(self.backend.close)
        except Exception:  # noqa: BLE001 - closing must not raise at exit
            pass
        self.history.close()

    # -- the demo: prompts that type themselves ------------------------------------------
    @work(group="typing", exclusive=True)
    async def type_next_prompt(self) -> None:
        if not self.script or self._quitting:
            return
        text = self.script.pop(0)
        await asyncio.sleep(0.4)
        typed = ""
        for ch in text:
            if self._quitting or (self.current is not None and not self.current.finished):
                return
            typed += ch
            self.prompt.set_text(typed)
            await asyncio.sleep(self.type_delay_s)
        await asyncio.sleep(0.2)
        await self.submit(text)
        if text.startswith("/") and self.script:  # commands produce no reply: go on
            self.type_next_prompt()

    # -- helpers -------------------------------------------------------------------------
    def _lookup_text(self, token_id: int) -> str | None:
        return self._token_text.get(token_id) or self.backend.token_text(token_id)

    async def _warn(self, message: str) -> None:
        await self.chat.add_notice("warning: " + message, "warning")
        self.notify(message, severity="warning", timeout=8)

    async def _check_recorder(self) -> None:
        r = self.recorder
        if r is not None and r.error:
            self.recorder = None  # one notice, no more writes (launch still closes the file)
            await self._warn(f"{r.stopped_reason}; the chat goes on")

    async def _check_history(self) -> None:
        w = self.history.warning
        if w and w != getattr(self, "_shown_warning", None):
            self._shown_warning = w
            await self._warn(w)
