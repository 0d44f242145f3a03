"""The chat on screen: a thin widget that composes the transcript, prompt box, panel and cache view, and
forwards keys and messages to its :class:`~ssd_chat.tui.controller.ChatController` (Textual dispatches
``on_*`` handlers to widgets only), which owns the conversation and does the work."""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widget import Widget
from textual.widgets import Static

from ..chat.backend import Backend
from ..history.store import History
from .comparing import CompareDone, CompareRun
from .controller import ChatController
from .replies import FRAME_S, ReplyEvent
from .widgets.cache_view import CacheView
from .widgets.chat_log import AssistantMessage, BranchStep, ChatLog, CopyBlock, UserMessage
from .widgets.figures import Baseline
from .widgets.load_status import LoadStatus
from .widgets.metrics_panel import MetricsPanel
from .widgets.prompt_input import PromptInput


def controlled(path: str) -> Any:
    """The controller's attribute ``path`` (dotted), read and written through the view: where the tests find the chat's state."""
    owner, _, name = path.rpartition(".")
    at = attrgetter(owner) if owner else (lambda ctl: ctl)
    return property(lambda view: getattr(at(view.controller), name), lambda view, value: setattr(at(view.controller), name, value))


class ChatView(Widget):
    """Transcript + prompt on the left, live speculation panel and cache view on the right."""

    ready, current, session, messages = map(controlled, ("ready", "current", "session", "session.messages"))
    conversation_id, params, system, switching = map(controlled, ("conversation_id", "params", "system", "switching"))
    load_error, _reply_worker, submit = map(controlled, ("load_error", "replies.worker", "submit"))  # submit: as Enter

    def __init__(self, backend: Backend, history: History, *, settings: dict[str, Any], recorder: Any = None,
                 script: Iterable[str] = (), type_delay_s: float = 0.03, baselines: Iterable[Baseline] = ()) -> None:
        super().__init__(id="chat-view")
        self.baselines = list(baselines)
        self.chat, self.panel = ChatLog(id="chat"), MetricsPanel(id="panel")
        self.cache, self.prompt = CacheView(id="cache"), PromptInput(id="prompt")
        self.controller = ChatController(self, backend, history, settings=settings, recorder=recorder, script=script,
                                         type_delay_s=type_delay_s)

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

    async def on_mount(self) -> None:
        ctl = self.controller
        for b in self.baselines:
            self.panel.set_measured(b)
        self.cache.token_text = ctl.lookup_text
        self.prompt.focus()
        ctl.replies.frames = self.set_interval(FRAME_S, ctl.replies.frame, pause=True)  # runs only while a reply streams
        self.set_interval(2.0, ctl.compile_progress)
        await ctl.rerun.refresh_hint()

    # -- messages: forwarded to the part that handles them ----------------------------------
    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        await self.controller.submit(event.text)

    async def on_prompt_input_complete(self, event: PromptInput.Complete) -> None:
        await self.controller.models.complete(event)

    async def on_reply_event(self, msg: ReplyEvent) -> None:
        await self.controller.replies.on_event(msg)

    async def on_compare_run(self, msg: CompareRun) -> None:
        await self.controller.compare.on_run(msg)

    async def on_compare_done(self, msg: CompareDone) -> None:
        await self.controller.compare.on_done(msg)

    async def on_branch_step(self, msg: BranchStep) -> None:
        msg.stop()
        await self.controller.branches.step(msg)

    async def on_user_message_edit_requested(self, msg: UserMessage.EditRequested) -> None:
        widgets = list(self.chat.query(UserMessage))
        if msg.message in widgets:
            await self.controller.rerun.start_edit(widgets.index(msg.message))

    def on_copy_block(self, msg: CopyBlock) -> None:
        self.controller.attach.copy_block(msg)

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
