"""The chat's controller, no widget: :class:`ChatController` owns the session, history, backend and the reply in
progress, and the parts that act on them, plain objects holding it: :class:`.Replies` (a prompt and its
streaming reply), :class:`.Rerun` and :class:`.Branches` (regenerate, edit; ←/→), :class:`.ChatActions` and
:class:`.Attachments` (between replies; files in, code blocks out), :class:`.Comparison` (Ctrl+G) and
:class:`.ModelSwitch` (``/model``).  What a key or a command does is written here once, top-down: :meth:`submit`
is one Enter, :meth:`command` every slash command, :meth:`stop` Esc.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..chat.backend import Backend
from ..history.store import History
from ..chat.session import Session
from ..engine import SamplingParams
from ..chat.terminal import printable
from .actions import HELP, Attachments, ChatActions
from .comparing import Comparison
from .replies import Replies, Turn, settle
from .rerun import Branches, Rerun
from .switch_model import ModelSwitch
from ..chat.changes import SLASH_KEYS


class ChatController:
    """One chat; ``view`` is the widget that shows it (its transcript, prompt box, panel and cache view)."""

    def __init__(self, view: Any, backend: Backend, history: History, *, settings: dict[str, Any], recorder: Any,
                 script: Iterable[str], type_delay_s: float) -> None:
        self.view, self.backend, self.history, self.recorder = view, backend, history, recorder
        self.session = self.new_session(settings.get("system") or None)
        self.params: dict[str, Any] = settings.get("sampling", SamplingParams()).choices()  # resolved: cli/options.settings
        self.colour = bool(settings.get("colour_tokens"))
        self.conversation_id: int | None = None
        self.script = list(script) or list(backend.scripted_prompts)
        self.type_delay_s = type_delay_s
        self.ready = False
        self.load_error: str | None = None
        self.current: Turn | None = None
        self.switching: str | None = None  # an engine change in progress ("mode sd"): prompts wait for it
        self.pending_settings: dict[str, Any] = {}  # changed while the model loads: applied once it is ready
        self.engine_changes: dict[str, Any] = {}  # mode / k / fan-out changed since the load: a /model switch keeps them
        self.quitting = False
        self._shown_warning: str | None = None
        self.replies, self.rerun, self.branches, self.actions = Replies(self), Rerun(self), Branches(self), ChatActions(self)
        self.attach, self.compare, self.models = Attachments(self), Comparison(self), ModelSwitch(self)

    # -- the conversation: a Session over the backend --------------------------------------
    def new_session(self, system: str | None, messages: list[dict[str, str]] | None = None) -> Session:
        """A fresh conversation (a new chat, a resumed one).  A reply still ending in its worker after Esc
        finishes into the session it started in, never into the next chat.  The system prompt is a message
        (the first one here), as it is in the saved chat: the two hold the same messages."""
        start = [{"role": "system", "content": system}] if system and messages is None else []
        return Session(messages=start + list(messages or []), reply=self.backend.stream)

    @property
    def system(self) -> str | None:
        """The system prompt in force: the next reply gets it."""
        return self.session.system_in_force

    def streaming(self) -> bool:
        return self.current is not None and not self.current.finished

    # -- keys and commands, each in one explicit order -------------------------------------
    async def submit(self, text: str) -> None:
        """Enter (and a demo's typed prompt): re-run the chat from an edit in progress, run a slash command, or send."""
        text = text.strip("\n")
        if self.rerun.edit_open(text):
            if await self.rerun.can_rerun():
                await self.rerun.rerun_from(self.rerun.editing.index, text, edited=True)
            return
        if text.startswith("/"):
            self.view.prompt.remember(text)
            self.view.prompt.set_text("")
            await self.command(text)
        else:
            await self.replies.send(text)
        await self.rerun.refresh_hint()

    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name == "model":
            await self.models.command(arg)
        elif name in ("regen", "regenerate"):
            await self.rerun.regenerate()
        elif name == "edit":
            if arg and not (arg.isascii() and arg.isdigit() and int(arg) >= 1):
                await self.view.chat.add_notice(f"usage: /edit [N], N counting your messages from 1; got '{arg}'", "warning")
            else:
                await self.rerun.start_edit(int(arg) - 1 if arg else None)
        elif name == "attach":
            await self.attach.command(arg)
        elif name == "save":
            await self.attach.save_block(arg)
        elif name in SLASH_KEYS:
            await self.actions.settings_command(name, arg)
        elif name == "system":
            await self.actions.set_system(arg)
        elif name == "new":
            await self.new_chat()
        elif name == "copy":
            self.actions.copy_reply()
        elif name == "chats":
            self.view.app.action_chats()
        elif name in ("colour", "color"):
            self.actions.toggle_colour()
        elif name == "compare":
            if arg:
                self.view.prompt.set_text(arg)
            await self.compare.start()
        elif name == "help":
            await self.view.chat.add_notice(HELP)
        else:
            await self.view.chat.add_notice(f"unknown command '/{name}' — /help lists them", "warning")

    async def stop(self) -> None:
        """Esc: stop the reply or the comparison; with nothing running, cancel an edit in progress."""
        if (ed := self.rerun.editing) is not None and not self.streaming() and self.compare.stop is None:
            self.rerun.end_edit()  # the box gets back what it held before the edit
            self.view.prompt.set_text(ed.draft)
            self.view.prompt.focus()
            self.view.app.notify("edit cancelled")
            return
        if self.compare.stop is not None:
            self.compare.stop.set()
        await self.replies.stop()

    async def new_chat(self) -> None:
        if self.streaming():
            self.view.app.notify("stop the reply first (Esc)", severity="warning")
        else:
            await self.actions.clear()
            self.session, self.conversation_id = self.new_session(self.system), None
            await self.view.chat.add_notice("new chat")
            self.rerun.end_edit()
        await self.rerun.refresh_hint()

    async def resume(self, conversation_id: int) -> bool:
        ok = await self.actions.resume(conversation_id)
        if ok:
            self.rerun.end_edit()
        await self.rerun.refresh_hint()
        return ok

    async def chat_deleted(self, conversation_id: int) -> None:
        """A chat was deleted in Ctrl+R.  The open one's next message would have no saved chat to go to (and
        the failed write would put the whole history in memory), so the chat goes on as a new one."""
        if conversation_id == self.conversation_id:
            if self.streaming():
                await self.stop()
            await self.new_chat()
            if self.conversation_id is None:
                await self.view.chat.add_notice(f"chat {conversation_id} was deleted; this is a new chat")

    # -- the model: loaded or not --------------------------------------------------------
    async def loaded(self) -> None:
        """The backend is ready: replies can start, settings chosen meanwhile apply, the demo types."""
        self.ready = True
        self.update_info()
        if self.pending_settings:  # prompts wait for the switch, as after /mode; keys are not held up by it
            self.switching = "the settings chosen while loading"
            self.view.run_worker(self.actions.apply_pending(), exclusive=False)
        if self.script:
            self.replies.type_next_prompt()

    async def load_failed(self, error: str) -> None:
        self.load_error = error
        hint = " — /model NAME loads another, Ctrl+C quits" if self.view.app.backend_factory is not None else " — press Ctrl+C to quit"
        await self.view.chat.add_notice(error + hint, "error")

    def update_info(self, mode_label: str | None = None) -> None:
        """The panel and the status line; ``mode_label``: the mode that is really running this reply."""
        info = dict(self.backend.info())
        info.setdefault("sampling", {**self.backend.sampling_defaults(), **self.params})  # what a reply samples with
        if mode_label is not None:
            info["mode_label"] = mode_label
        self.view.panel.set_info(info)
        shown = mode_label if mode_label is not None else (info.get("mode") or "?").upper()
        simulated = f" · SIMULATED {info['simulated']}" if info.get("simulated") else ""  # a recording made on simulated hardware
        self.view.app.sub_title = printable(f"{shown} · {info.get('target') or ''}{simulated}", one_line=True)

    def compile_progress(self) -> None:
        """While the target's graphs build in the background, the panel's "compiling" row counts up;
        the next reply (not the one under way) runs compiled once it is done."""
        if self.view.panel.info.get("compiling"):
            self.update_info()

    # -- quitting ------------------------------------------------------------------------
    async def close(self) -> None:
        """Stop any reply or comparison and wait for the engine thread; then write the recording's vocabulary."""
        self.quitting = True
        self.script.clear()
        if self.current is not None and self.current.status == "streaming":
            await self.stop()
        await settle(self.replies.worker, 15)
        if self.compare.stop is not None:  # the comparison stops at its next token; the engine is back in its mode after
            self.compare.stop.set()
        await settle(self.compare.worker, 15)
        if self.recorder is not None:
            vocab = {i: s for i in sorted(self.replies.seen_ids) if (s := self.lookup_text(i)) is not None}
            if vocab:
                self.recorder.vocab(vocab)
            self.recorder.close()

    # -- helpers -------------------------------------------------------------------------
    def lookup_text(self, token_id: int) -> str | None:
        return self.replies.token_text.get(token_id) or self.backend.token_text(token_id)

    async def warn(self, message: str) -> None:
        await self.view.chat.add_notice("warning: " + message, "warning")
        self.view.app.notify(message, severity="warning", timeout=8)

    async def check_recorder(self) -> None:
        r = self.recorder
        if r is not None and r.error:
            self.recorder = None  # one notice, no more writes (launch still closes the file)
            await self.warn(f"{r.stopped_reason}; the chat goes on")

    async def check_history(self) -> None:
        self.history.retry()
        w = self.history.warning
        if w and w != self._shown_warning:
            self._shown_warning = w
            await self.warn(w)
        if self.history.resumed:
            message, self.history.resumed, self._shown_warning = self.history.resumed, None, None
            await self.view.chat.add_notice(message, "info")
