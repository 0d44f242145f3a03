"""The chat app: the window around one :class:`~ssd_chat.tui.chat_view.ChatView`.

The chat (its session, transcript, prompt box and panel) is the widget and its controller; the app holds what is not
one chat's: the keys, the dialogs and the command palette, loading the backend in a thread, the
saved-chat history and quitting (Ctrl+C, SIGTERM, SIGHUP).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.widgets import Footer, Header

from ..chat.backend import Backend, readable
from ..engine import threads, processes, Notice
from ..history.store import History
from ..chat.terminal import printable
from . import signals
from .chat_view import ChatView
from .replies import ReplyEvent
from .widgets.chat_log import AssistantMessage, BranchStep, CopyBlock
from .widgets.chats_dialog import ChatsDialog
from .widgets.figures import Baseline
from .widgets.load_status import LoadStatus
from .widgets.settings_dialog import SettingsDialog
from .widgets.system_prompt import SystemPromptDialog


UI_NICE = 10  # app/ask 0.69 -> 0.80 in AR on 2 cores: drawing waits while the decoder's threads want the cores


def yield_to_engine() -> None:
    """Lower every thread of the app's own process (not the engine process, started before, nor the thread that
    starts engine processes: one started after /model inherits its priority): on a machine whose cores the decoder
    fills, the drawing takes what the decoder leaves instead of stalling its threads."""
    with contextlib.suppress(OSError, AttributeError, ValueError):  # not Linux, or a thread gone meanwhile: the app runs as it is
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != processes.spawner_tid:
                os.setpriority(os.PRIO_PROCESS, int(tid), min(19, os.getpriority(os.PRIO_PROCESS, int(tid)) + UI_NICE))


class ChatApp(App[int]):
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

    class LoadProgress(Message):
        def __init__(self, stage: str, frac: float | None) -> None:
            super().__init__()
            self.stage, self.frac = stage, frac

    class Loaded(Message):
        def __init__(self, error: str | None, backend: Backend | None = None) -> None:
            super().__init__()
            self.error, self.backend = error, backend

    def __init__(self, backend: Backend, *, settings: dict[str, Any] | None = None, history: History | None = None,
                 recorder: Any = None, resume: int | None = None, script: Iterable[str] = (), type_delay_s: float = 0.03,
                 baselines: Iterable[Baseline] = (), backend_factory: Callable[[dict[str, Any]], Backend] | None = None) -> None:
        super().__init__()
        self.backend = backend
        # /model builds the next backend from these settings with another target (None: this app cannot switch)
        self.values, self.backend_factory = dict(settings or {}), backend_factory
        self.history = history if history is not None else History(None)
        self.resume_id = resume
        self._quitting = False
        self._yielded = False
        self.signalled: int | None = None  # SIGTERM / SIGHUP that made the app quit
        # k and fan-out as started with: the settings dialog shows them until the engine says what it has
        self.engine_settings = {key: (settings or {}).get(key) for key in ("k", "fan_out")}
        self.chat_view = ChatView(backend, self.history, settings=dict(settings or {}), recorder=recorder, script=script,
                                  type_delay_s=type_delay_s, baselines=baselines)
        self.controller = self.chat_view.controller  # what the keys, dialogs and palette act on

    def notify(self, message: str, *, title: str = "", severity: Any = "information", timeout: float | None = None,
               markup: bool = False) -> None:
        """Plain text unless asked: notifications quote paths, model names and chat titles."""
        super().notify(printable(message), title=title, severity=severity, timeout=timeout, markup=markup)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # off behind a dialog: it has its own keys (ctrl+s saves the system prompt there)
        return not (action in self.MAIN_SCREEN_ACTIONS and isinstance(self.screen, ModalScreen))

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield self.chat_view
        yield Footer()

    async def on_mount(self) -> None:
        self.compute_threads = threads.coordinator()  # the UI thread starts no OpenMP pool (engine/threads.py)
        self.sub_title = "loading…"
        signals.catch(self)  # SIGTERM / SIGHUP quit as Ctrl+C does
        await self.controller.check_history()  # the start's warning: shown once, not again at the first prompt
        self.set_interval(2.0, self.controller.check_history)  # writes held back by a lock are saved when it goes, even when idle
        if self.resume_id is not None:
            await self.controller.resume(self.resume_id)
        self.start_load()

    # -- loading -------------------------------------------------------------------------
    def start_load(self) -> None:
        """Load ``self.backend`` with the load line: at startup, and after ``/model`` built another."""
        self.sub_title = "loading…"
        load = self.query_one(LoadStatus)
        if not load.display or load.has_class("-failed"):  # shown again: a load after /model
            load.restart()
        # a daemon thread: quitting during a long load must not wait for it to finish
        threading.Thread(target=self._load, args=(self.backend,), name="ssd-chat-load", daemon=True).start()

    def _load(self, backend: Backend) -> None:
        threads.worker(self.compute_threads)
        # warnings found before loading (a model too large for this machine) reach the chat at once
        backend.warn = lambda message: self.chat_view.post_message(ReplyEvent(-1, Notice(message, "warning")))
        try:
            backend.load(lambda stage, frac: self.post_message(self.LoadProgress(stage, frac)))
        except BaseException as e:  # noqa: BLE001 - shown in the app, never as a traceback
            self.post_message(self.Loaded(f"could not load the model: {readable(e)}", backend))
            return
        if getattr(backend, "proc", None) is not None and not self._yielded:  # the engine runs in a process of its own
            self._yielded = True  # once: a /model reload must not lower the app's threads again
            yield_to_engine()
        self.post_message(self.Loaded(None, backend))

    def on_chat_app_load_progress(self, msg: LoadProgress) -> None:
        self.query_one(LoadStatus).set_stage(msg.stage, msg.frac)

    async def on_chat_app_loaded(self, msg: Loaded) -> None:
        if msg.backend is not None and msg.backend is not self.backend:
            return  # a backend replaced meanwhile
        load = self.query_one(LoadStatus)
        if msg.error:
            load.fail(msg.error)
            self.sub_title = "load failed"
            await self.controller.load_failed(msg.error)
            return
        load.display = False
        await self.controller.loaded()

    # -- quitting ------------------------------------------------------------------------
    async def action_quit_key(self) -> None:
        await self.action_quit()

    async def action_quit(self) -> None:
        """Ctrl+C / q: stop any reply, wait for the engine thread, release models, exit."""
        if self._quitting:
            return
        self._quitting = True
        await self.controller.close()
        with contextlib.suppress(Exception):  # closing must not raise at exit
            await asyncio.to_thread(self.backend.close)
        self.history.close()
        self.exit(0)

    # -- keys: the chat does the work --------------------------------------------------------
    async def action_new_chat(self) -> None:
        await self.controller.new_chat()

    def action_copy_reply(self) -> None:
        self.controller.actions.copy_reply()

    def action_toggle_colour(self) -> None:
        self.controller.actions.toggle_colour()

    async def action_stop(self) -> None:
        await self.controller.stop()

    async def action_compare(self) -> None:
        await self.controller.compare.start()

    async def action_regenerate(self) -> None:
        await self.controller.rerun.regenerate()

    # -- dialogs -------------------------------------------------------------------------
    def _ask(self, dialog: ModalScreen, then: Callable[[Any], Awaitable[Any]]) -> None:
        """Open ``dialog``; unless it is cancelled (None) or changes nothing ({}), ``then(answer)`` runs in a worker."""
        def done(answer: Any) -> None:
            if answer is not None and answer != {}:
                self.run_worker(then(answer), exclusive=False)

        self.push_screen(dialog, done)

    def action_system_prompt(self) -> None:
        self._ask(SystemPromptDialog(self.controller.system), self.controller.actions.set_system)  # "" clears it

    def action_settings(self) -> None:
        ctl = self.controller
        if ctl.load_error:
            self.run_worker(ctl.actions.apply_settings({}), exclusive=False)  # says why nothing can change
            return
        current = {"settings": self.engine_settings, **self.backend.info(), **self.backend.sampling_defaults(), **ctl.params,
                   **ctl.pending_settings}  # the temperature in force
        self._ask(SettingsDialog(current), ctl.actions.apply_settings)

    def action_chats(self) -> None:
        self._ask(ChatsDialog(self.history), self.controller.resume)

    async def on_chats_dialog_deleted(self, msg: ChatsDialog.Deleted) -> None:
        await self.controller.chat_deleted(msg.conversation_id)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        ctl = self.controller
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", self.action_new_chat)
        yield SystemCommand("Copy last reply", "Copy the last reply to the clipboard (Ctrl+Y)", self.action_copy_reply)
        yield SystemCommand("System prompt", "Change the system prompt (Ctrl+S)", self.action_system_prompt)
        yield SystemCommand("Settings", "Mode, k, fan-out, temperature, top-p, top-k, seed, repeat penalty, max tokens (Ctrl+O)", self.action_settings)
        for m in ("ar", "sd", "ssd"):
            yield SystemCommand(f"Switch to {m.upper()}", f"Decode the next reply with {m.upper()} (models stay loaded)",
                                lambda m=m: self.run_worker(ctl.actions.apply_settings({"mode": m})))
        yield SystemCommand("Switch to AUTO", "Back to the mode auto chose for this machine, with its why line (models stay loaded)",
                            lambda: self.run_worker(ctl.actions.apply_settings({"mode": "auto"})))
        yield SystemCommand("Compare AR, SD and SSD", "The prompt in the box (or the last one) in each mode: tok/s, identical? (Ctrl+G)",
                            self.action_compare)
        yield SystemCommand("Chats", "Resume or delete a saved chat (Ctrl+R)", self.action_chats)
        yield SystemCommand("Export chat as Markdown", "With each reply's metrics, to the data dir's exports/", lambda: ctl.actions.export_chat("md"))
        yield SystemCommand("Export chat as JSONL", "With each reply's metrics, to the data dir's exports/", lambda: ctl.actions.export_chat("jsonl"))
        yield SystemCommand("Toggle token colours", "Colour accepted draft vs target tokens (Ctrl+T)", self.action_toggle_colour)
        yield SystemCommand("Stop reply", "Stop the reply and keep what streamed (Esc)", self.action_stop)
        yield SystemCommand("Help", "Keys and commands", lambda: self.run_worker(ctl.command("/help")))
        yield SystemCommand("Regenerate last reply", "Decode the last reply again with the current settings; the old one stays as a branch (F5)",
                            self.action_regenerate)
        yield SystemCommand("Edit your last message", "Put it back in the box; Enter re-runs the chat from it "
                            "(earlier ones: Shift+Tab to one and press e, or /edit N)", ctl.rerun.start_edit)
        # the keys of a focused message (Shift+Tab), here for the last reply
        yield SystemCommand("Previous branch", "Show the last reply's sibling before it (← on a message focused with Shift+Tab)",
                            lambda: self._on_last_reply(lambda w: BranchStep(w, -1)))
        yield SystemCommand("Next branch", "Show the last reply's sibling after it (→ on a message focused with Shift+Tab)",
                            lambda: self._on_last_reply(lambda w: BranchStep(w, 1)))
        yield SystemCommand("Copy a code block", "The last reply's next code block (c on a message focused with Shift+Tab)",
                            lambda: self._on_last_reply(CopyBlock))
        yield SystemCommand("Save a code block", "List the last reply's code blocks; /save N FILE writes one",
                            lambda: self.run_worker(ctl.attach.save_block("")))
        yield SystemCommand("Attach a file", "Put /attach in the box: a text file into your next message", self._start_attach)
        yield SystemCommand("Switch model", "The local models; /model NAME switches the target for the next chat",
                            lambda: self.run_worker(ctl.models.command("")))

    def _on_last_reply(self, message: Any) -> None:
        replies = list(self.chat_view.chat.query(AssistantMessage))
        if not replies:
            self.notify("no reply yet")
            return
        self.chat_view.post_message(message(replies[-1]))

    def _start_attach(self) -> None:
        self.chat_view.prompt.set_text("/attach ")
        self.chat_view.prompt.focus()
