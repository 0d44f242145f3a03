"""The chat app: transcript + prompt on the left, live speculation panel and cache view on the right.

Engine work runs in thread workers that only post messages; handlers here touch the widgets.  The
conversation is a :class:`~ssd_chat.session.Session`, as in ``ask`` and the demo; this module holds
the layout, loading, quitting and the state the mixins share: :mod:`.replies` (a prompt and its
streaming reply), :mod:`.actions` (keys, settings, saved chats, slash commands) and
:mod:`.comparing` (AR, SD and SSD on one prompt).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from typing import Any

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Footer, Header, Static

from ..config import sampling_settings
from ..engine import threads
from ..engine.events import Event, Notice
from ..history import History
from ..session import Session
from ..terminal import printable
from . import signals
from .actions import ChatActions
from ..backend import Backend, readable
from .comparing import CompareActions
from .figures import Baseline
from .replies import ReplyActions, Turn
from .rerun import RerunActions
from .widgets.cache_view import CacheView
from .widgets.chat_log import ChatLog
from .widgets.load_status import LoadStatus
from .widgets.metrics_panel import MetricsPanel
from .widgets.prompt_input import PromptInput

FRAME_S = 0.1  # screen updates while streaming: 10 per second


class ChatApp(RerunActions, ReplyActions, CompareActions, ChatActions, App[int]):
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
        Binding("f5", "regenerate", "Regenerate"),  # edit an earlier message: Shift+Tab to it, e (tui/rerun.py)
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
        self.session = self.new_session(settings.get("system") or None)
        self.params: dict[str, Any] = sampling_settings(settings)
        self.colour = bool(settings.get("colour_tokens"))
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
        self.pending_settings: dict[str, Any] = {}  # changed while the model loads: applied once it is ready
        self._token_text: dict[int, str] = {}
        self._seen_ids: set[int] = set()
        self._quitting = False
        self.signalled: int | None = None  # SIGTERM / SIGHUP that made the app quit

    # -- the conversation: a Session over the backend --------------------------------------
    def new_session(self, system: str | None, messages: list[dict[str, str]] | None = None) -> Session:
        """A fresh conversation (a new chat, a resumed one).  A reply still ending in its worker after Esc
        finishes into the session it started in, never into the next chat."""
        return Session(system=system, messages=messages, reply=self.backend.stream)

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.session.messages

    @messages.setter
    def messages(self, value: list[dict[str, str]]) -> None:
        self.session.messages = list(value)

    @property
    def system(self) -> str | None:
        return self.session.system

    @system.setter
    def system(self, value: str | None) -> None:
        self.session.system = value

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
        self.compute_threads = threads.coordinator()  # the UI thread starts no OpenMP pool (engine/threads.py)
        self.sub_title = "loading…"
        for b in self.baselines:
            self.panel.set_measured(b)
        self.cache.token_text = self._lookup_text
        self.prompt.focus()
        signals.catch(self)  # SIGTERM / SIGHUP quit as Ctrl+C does
        self._flush_lock = asyncio.Lock()
        self._frames = self.set_interval(FRAME_S, self._flush_pending, pause=True)  # runs only while a reply streams
        await self._check_history()  # the start's warning: shown once, not again at the first prompt
        self.set_interval(2.0, self._check_history)  # writes held back by a lock are saved when it goes, even when idle
        if self.resume_id is not None:
            await self.resume(self.resume_id)
        self.load_backend()

    # -- loading -------------------------------------------------------------------------
    def load_backend(self) -> None:
        """Load in a daemon thread: quitting during a long load must not wait for it to finish."""
        threading.Thread(target=self._load, name="ssd-chat-load", daemon=True).start()

    def _load(self) -> None:
        threads.worker(self.compute_threads)
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
        if self.pending_settings:  # prompts wait for the switch, as after /mode; keys are not held up by it
            self.switching = "the settings chosen while loading"
            self.run_worker(self.apply_pending(), exclusive=False)
        if self.script:
            self.type_next_prompt()

    def _update_info(self) -> None:
        info = dict(self.backend.info())
        info.setdefault("sampling", {**self.backend.sampling_defaults(), **self.params})  # what a reply samples with
        self.panel.set_info(info)
        self.sub_title = printable(f"{(info.get('mode') or '?').upper()} · {info.get('target') or ''}", one_line=True)

    def _show_mode(self, label: str) -> None:
        """The status line and the panel name the mode that is really running this reply."""
        info = dict(self.backend.info())
        info.setdefault("sampling", {**self.backend.sampling_defaults(), **self.params})  # what a reply samples with
        info["mode_label"] = label
        self.panel.set_info(info)
        self.sub_title = f"{label} · {info.get('target') or ''}"

    @on(PromptInput.Submitted)
    async def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        await self.submit(event.text)

    # -- quitting ------------------------------------------------------------------------
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
        self.history.retry()
        w = self.history.warning
        if w and w != getattr(self, "_shown_warning", None):
            self._shown_warning = w
            await self._warn(w)
        if self.history.resumed:
            message, self.history.resumed, self._shown_warning = self.history.resumed, None, None
            await self.chat.add_notice(message, "info")
