"""The chat: one widget that owns the conversation, its transcript, the prompt box and the side panel.

:class:`ChatView` holds a :class:`~ssd_chat.chat.session.Session` (as ``ask`` and the demo do) and the
state of the reply in progress.  Its behaviour is written by role in one module each:
:mod:`.replies` (a prompt and its streaming reply, Esc), :mod:`.actions` (new chat, settings, saved
chats, slash commands), :mod:`.rerun` (regenerate, edit and re-run), :mod:`.branches` (the
siblings they leave, ←/→), :mod:`.attaching` (files into a prompt, code blocks out of a message),
:mod:`.comparing` (AR, SD and SSD on one prompt) and :mod:`.switch_model` (``/model``: another target).  The app around it loads the backend, opens the
dialogs, owns the keys and quits.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable
from typing import Any

from textual import events, on
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Static

from ..chat.backend import Backend
from ..engine.events import Event
from ..engine.params import SamplingParams
from ..history.store import History
from ..chat.session import Session
from ..chat.terminal import printable
from .actions import ChatActions
from .attaching import AttachActions
from .branches import BranchActions
from .comparing import CompareActions
from .figures import Baseline
from .replies import ReplyActions, Turn, settle
from .rerun import RerunActions
from .switch_model import ModelActions
from .widgets.cache_view import CacheView
from .widgets.chat_log import AssistantMessage, ChatLog, UserMessage
from .widgets.load_status import LoadStatus
from .widgets.metrics_panel import MetricsPanel
from .widgets.prompt_input import PromptInput


def sim_note(info: dict) -> str:
    """The title's mark on a recording made on simulated hardware."""
    return f" · SIMULATED {info['simulated']}" if info.get("simulated") else ""


FRAME_S = 0.1  # screen updates while streaming: 10 per second at most (replies.UI_SHARE)


class ChatView(ModelActions, BranchActions, RerunActions, AttachActions, ReplyActions, CompareActions, ChatActions, Widget):
    """Transcript + prompt on the left, live speculation panel and cache view on the right."""

    class ReplyEvent(Message, bubble=False):
        """An engine event of reply ``turn`` (-1: a warning from loading), posted by a worker thread."""

        def __init__(self, turn: int, event: Event) -> None:
            super().__init__()
            self.turn, self.event = turn, event

    def __init__(
        self,
        backend: Backend,
        history: History,
        *,
        settings: dict[str, Any],
        recorder: Any = None,
        script: Iterable[str] = (),
        type_delay_s: float = 0.03,
        baselines: Iterable[Baseline] = (),
    ) -> None:
        super().__init__(id="chat-view")
        self.backend, self.history, self.recorder = backend, history, recorder
        self.session = self.new_session(settings.get("system") or None)
        self.params: dict[str, Any] = settings.get("sampling", SamplingParams()).choices()  # resolved: cli/options.settings
        self.colour = bool(settings.get("colour_tokens"))
        self.conversation_id: int | None = None
        self.script = list(script) or list(backend.scripted_prompts)
        self.type_delay_s = type_delay_s
        self.baselines = list(baselines)
        self.ready = False
        self.load_error: str | None = None
        self.current: Turn | None = None
        self.turn_count = 0
        self.clipboard_text: str | None = None
        self.attachments: list[tuple[Any, int | None]] = []  # files /attach staged for the next message, with their tokens
        self._reply_worker: Any = None
        self.switching: str | None = None  # an engine change in progress ("mode sd"): prompts wait for it
        self.pending_settings: dict[str, Any] = {}  # changed while the model loads: applied once it is ready
        self.engine_changes: dict[str, Any] = {}  # mode / k / fan-out changed since the load: a /model switch keeps them
        self._token_text: dict[int, str] = {}
        self._seen_ids: set[int] = set()
        self._quitting = False
        self._shown_warning: str | None = None
        self._flush_lock = asyncio.Lock()
        self.inbox: collections.deque[tuple[int, Event]] = collections.deque()  # (turn, event) from the reply's worker
        self.chat, self.panel = ChatLog(id="chat"), MetricsPanel(id="panel")
        self.cache, self.prompt = CacheView(id="cache"), PromptInput(id="prompt")

    # -- the conversation: a Session over the backend --------------------------------------
    def new_session(self, system: str | None, messages: list[dict[str, str]] | None = None) -> Session:
        """A fresh conversation (a new chat, a resumed one).  A reply still ending in its worker after Esc
        finishes into the session it started in, never into the next chat.  The system prompt is a message
        (the first one here), as it is in the saved chat: the two hold the same messages."""
        start = [{"role": "system", "content": system}] if system and messages is None else []
        return Session(messages=start + list(messages or []), reply=self.backend.stream)

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.session.messages

    @messages.setter
    def messages(self, value: list[dict[str, str]]) -> None:
        self.session.messages = list(value)

    @property
    def system(self) -> str | None:
        """The system prompt in force: the next reply gets it."""
        return self.session.system_in_force

    # -- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Vertical(id="main"):
            yield LoadStatus(id="load")
            yield self.chat
            yield self.prompt
        with Vertical(id="side"):
            yield Static("Speculation", classes="side-title")
            yield self.panel
            yield Static("Speculation cache: latest rounds (j: predicted bonus)", classes="side-title")
            yield self.cache

    def on_mount(self) -> None:
        for b in self.baselines:
            self.panel.set_measured(b)
        self.cache.token_text = self._lookup_text
        self.prompt.focus()
        self._frames = self.set_interval(FRAME_S, self._frame, pause=True)  # runs only while a reply streams
        self.set_interval(2.0, self._compile_progress)

    def _compile_progress(self) -> None:
        """While the target's graphs build in the background, the panel's "compiling" row counts up;
        the next reply (not the one under way) runs compiled once it is done."""
        if self.panel.info.get("compiling"):
            self._update_info()

    @on(PromptInput.Submitted)
    async def on_prompt_submitted(self, event: PromptInput.Submitted) -> None:
        await self.submit(event.text)

    # -- the model: loaded or not --------------------------------------------------------
    async def loaded(self) -> None:
        """The backend is ready: replies can start, settings chosen meanwhile apply, the demo types."""
        self.ready = True
        self._update_info()
        if self.pending_settings:  # prompts wait for the switch, as after /mode; keys are not held up by it
            self.switching = "the settings chosen while loading"
            self.run_worker(self.apply_pending(), exclusive=False)
        if self.script:
            self.type_next_prompt()

    async def load_failed(self, error: str) -> None:
        self.load_error = error
        hint = " — /model NAME loads another, Ctrl+C quits" if self.app.backend_factory is not None else " — press Ctrl+C to quit"
        await self.chat.add_notice(error + hint, "error")

    def _update_info(self) -> None:
        info = dict(self.backend.info())
        info.setdefault("sampling", {**self.backend.sampling_defaults(), **self.params})  # what a reply samples with
        self.panel.set_info(info)
        self.app.sub_title = printable(f"{(info.get('mode') or '?').upper()} · {info.get('target') or ''}{sim_note(info)}", one_line=True)

    def _show_mode(self, label: str) -> None:
        """The status line and the panel name the mode that is really running this reply."""
        info = dict(self.backend.info())
        info.setdefault("sampling", {**self.backend.sampling_defaults(), **self.params})  # what a reply samples with
        info["mode_label"] = label
        self.panel.set_info(info)
        self.app.sub_title = printable(f"{label} · {info.get('target') or ''}{sim_note(info)}", one_line=True)

    # -- quitting ------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop any reply or comparison and wait for the engine thread; then write the recording's vocabulary."""
        self._quitting = True
        self.script.clear()
        if self.current is not None and self.current.status == "streaming":
            await self.action_stop()
        await settle(self._reply_worker, 15)
        await self.stop_compare()
        if self.recorder is not None:
            vocab = {i: s for i in sorted(self._seen_ids) if (s := self._lookup_text(i)) is not None}
            if vocab:
                self.recorder.vocab(vocab)
            self.recorder.close()

    def on_key(self, event: events.Key) -> None:
        """Typing on a message reached with Shift+Tab goes to the prompt box, as does Esc: the keys a focused
        message binds (e, ←/→, c) act first, and any other text is the user's next message."""
        focused = self.app.focused
        if not isinstance(focused, (UserMessage, AssistantMessage)):
            return
        own = {k.strip() for b in focused.BINDINGS for k in (b.key if hasattr(b, "key") else b[0]).split(",")}
        if event.key in own:
            return
        if event.key == "escape":  # and Esc still stops a reply that streams (the app's binding)
            self.prompt.focus()
        elif event.is_printable and event.character:
            self.prompt.focus()
            self.prompt.insert(event.character)
            event.stop()
            event.prevent_default()

    # -- helpers -------------------------------------------------------------------------
    def notify(self, message: str, *, title: str = "", severity: Any = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Plain text unless asked, as the app's (a widget's notify defaults to markup)."""
        self.app.notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

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

    async def check_history(self) -> None:
        self.history.retry()
        w = self.history.warning
        if w and w != self._shown_warning:
            self._shown_warning = w
            await self._warn(w)
        if self.history.resumed:
            message, self.history.resumed, self._shown_warning = self.history.resumed, None, None
            await self.chat.add_notice(message, "info")
