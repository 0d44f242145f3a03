"""Regenerate the last reply, and edit an earlier message and re-run the chat from it: the part of
:class:`~ssd_chat.tui.chat_view.ChatView` that rewrites the end of a conversation, plus the first-screen hint.

Both replace the conversation from one of the user's messages on, on screen and in the session, then
send that message (edited or not) through :meth:`ReplyActions.submit`, so the new reply streams, is
measured and is saved like any other, with the settings in force now.  Nothing is deleted: in the
saved chat the new message is a sibling of the old one (regenerate: a new reply to the same question),
and the old branch is one ←/→ away (:mod:`.branches`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.screen import ModalScreen
from textual.widgets import Static

from ..engine import SamplingParams
from ..history.store import LEAF, HistoryError
from .replies import Branch, settle
from .widgets.chat_log import AssistantMessage, UserMessage

HINT = ("Type a message and press Enter to send (Shift+Enter: new line) · /help lists the keys and commands · "
        "Ctrl+P opens the command palette")


class FirstHint(Static):
    """The line an empty chat shows; it goes when the first message is sent."""

    def __init__(self) -> None:
        super().__init__(HINT, classes="hint", markup=False)


@dataclass
class Editing:
    index: int  # which of the user's messages (0 = the first)
    session: Any  # the conversation it belongs to: a new chat or a resumed one ends the edit
    draft: str  # what was in the box before, put back when the edit is cancelled


class RerunActions:
    """``self`` is the ChatView."""

    editing: Editing | None = None

    # -- the first-screen hint -----------------------------------------------------------
    async def on_mount(self) -> None:  # after ChatView.on_mount (Textual calls each class's handler)
        await self.refresh_hint()

    async def refresh_hint(self) -> None:
        hints = list(self.chat.query(FirstHint))
        empty = not self.chat.query(UserMessage)
        if empty and not hints:
            await self.chat.mount(FirstHint())
        elif not empty and hints:
            await self.chat.remove_children(hints)

    async def action_new_chat(self) -> None:
        before = self.session
        await super().action_new_chat()
        if self.session is not before:
            self.end_edit()
        await self.refresh_hint()

    async def resume(self, conversation_id: int) -> bool:
        before = self.session
        ok = await super().resume(conversation_id)
        if self.session is not before:
            self.end_edit()
        await self.refresh_hint()
        return ok

    async def chat_deleted(self, conversation_id: int) -> None:
        """A chat was deleted in Ctrl+R.  The open one's next message would have no saved chat to go to (and
        the failed write would put the whole history in memory), so the chat goes on as a new one."""
        if conversation_id == self.conversation_id:
            if self.current is not None and not self.current.finished:
                await self.action_stop()
            await self.action_new_chat()
            if self.conversation_id is None:
                await self.chat.add_notice(f"chat {conversation_id} was deleted; this is a new chat")

    # -- sending: an edit in progress re-runs the chat from the edited message -----------
    async def submit(self, text: str) -> None:
        ed = self.editing
        if ed is not None and not text.strip("\n").startswith("/"):
            if ed.session is not self.session or ed.index >= len(self.chat.query(UserMessage)):
                self.end_edit()  # the chat it belonged to is gone: a plain message
            else:
                if await self.can_rerun():
                    await self.rerun_from(ed.index, text.strip("\n"), edited=True)
                return
        await super().submit(text)
        await self.refresh_hint()

    async def can_rerun(self) -> bool:
        """What :meth:`submit` checks before it sends, checked before anything is cut."""
        if self.backend.info().get("replay"):
            await self.chat.add_notice("a replayed session plays its recorded replies: it cannot regenerate or edit", "warning")
            return False
        if not self.ready:
            await self.chat.add_notice(self.load_error or "the model is still loading; try again when it is ready", "warning")
            return False
        if self.current is not None and not self.current.finished:
            self.notify("a reply is still streaming — Esc stops it", severity="warning")
            return False
        if self.switching is not None:
            await self.chat.add_notice(f"still switching to {self.switching}; try again after that", "warning")
            return False
        try:
            SamplingParams(**self.params)
        except ValueError as e:
            await self.chat.add_notice(str(e), "error")
            return False
        if await settle(self._reply_worker, 10):  # a stopped reply enters the session when its thread ends
            await self.chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
            return False
        return True

    async def rerun_from(self, index: int, text: str, *, edited: bool) -> None:
        """Send ``text`` in place of the user's message ``index``: a new branch beside it in the saved chat
        (regenerate: a new reply beside the last one); on screen and in the session, the chat from there on
        is replaced by the new branch."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        widgets = list(self.chat.query(UserMessage))
        if index >= len(users) or len(widgets) != len(users):
            await self.chat.add_notice("this chat changed meanwhile; nothing was re-run", "warning")
            self.end_edit()
            return
        cut, question = users[index], widgets[index]
        later_system = [m["content"] for m in self.messages[cut:] if m["role"] == "system"] if not edited else []
        # a new reply to the same saved question, unless a system prompt set after the old reply must come first
        same_question = not edited and not later_system and question.message_id is not None
        children = list(self.chat.children)
        # on screen: from the message on (an edit), or that message and its reply (regenerate: later
        # notices, such as a settings change, stay; the question stays when it gets a new reply)
        start = children.index(question) + (1 if same_question else 0)
        end = len(children)
        if not edited:
            end = next((i + 1 for i in range(start, len(children)) if isinstance(children[i], AssistantMessage)), end)
        await self.chat.remove_children(children[start:end])
        self.current = None  # a late event of the dropped reply finds no turn to write into
        self.messages = self.messages[:cut]
        branch = Branch(user=question) if same_question else Branch(parent=self._parent_of(question))
        branch.regenerated = not edited
        for value in later_system:  # set after the reply regenerated: it applies from the message sent again
            self.session.set_system(value)
            branch.parent = self.history.add_message(self.conversation_id, "system", value, parent=branch.parent)
        if edited:
            self.end_edit()
            if index == 0:  # the first prompt names the chat
                self.history.set_title(self.conversation_id, text)
            await self.chat.add_notice(f"re-running from your message {index + 1}, edited: the chat as it was "
                                       "stays as a branch (Shift+Tab to the message, ←/→ switch)")
            await super().submit(text, branch)
        else:
            draft = self.prompt.text  # regenerate leaves what is being typed in the box
            await self.chat.add_notice("regenerating the last reply with the current settings "
                                       "(the previous one stays as a branch: Shift+Tab to the reply, ←/→ switch)")
            await super().submit(text, branch)
            if draft.strip():
                self.prompt.set_text(draft)
        await self.refresh_hint()

    def _parent_of(self, question: UserMessage) -> Any:
        """The saved message the question follows (LEAF, the end of the branch, when it was never saved)."""
        if question.message_id is None or self.conversation_id is None:
            return LEAF
        try:
            return self.history.parent_of(question.message_id)
        except HistoryError:
            return LEAF

    # -- regenerate ----------------------------------------------------------------------
    async def action_regenerate(self) -> None:
        if isinstance(self.app.screen, ModalScreen):
            return  # F5 behind a dialog
        if self.editing is not None:
            await self.chat.add_notice("finish the edit first (Enter re-runs it, Esc cancels it)", "warning")
            return
        if not await self.can_rerun():
            return
        m = self.messages
        while m and m[-1]["role"] == "system":  # a system prompt set after the reply: the new one gets it
            m = m[:-1]
        if len(m) < 2 or m[-1]["role"] != "assistant" or m[-2]["role"] != "user":
            await self.chat.add_notice("no reply to regenerate yet", "warning")
            return
        await self.rerun_from(sum(x["role"] == "user" for x in m) - 1, m[-2]["content"], edited=False)

    # -- editing -------------------------------------------------------------------------
    async def start_edit(self, index: int | None = None) -> None:
        """Put the user's message ``index`` (None: the last) in the box; sending it re-runs the chat from there."""
        texts = [w.text for w in self.chat.query(UserMessage)]
        if self.current is not None and not self.current.finished:
            await self.chat.add_notice("stop the reply first (Esc), then edit", "warning")
            return
        if not texts:
            await self.chat.add_notice("nothing to edit yet: send a message first", "warning")
            return
        index = len(texts) - 1 if index is None else index
        if not 0 <= index < len(texts):
            await self.chat.add_notice(f"no message {index + 1}: this chat has {len(texts)} of yours (/edit 1 to /edit {len(texts)})", "warning")
            return
        draft = self.editing.draft if self.editing is not None else self.prompt.text
        self.editing = Editing(index, self.session, draft)
        self.prompt.set_text(texts[index])
        self.prompt.border_title = f"editing your message {index + 1} of {len(texts)} · Enter re-runs the chat from it · Esc cancels"
        self.prompt.focus()

    def end_edit(self) -> None:
        self.editing = None
        self.prompt.border_title = None

    async def on_user_message_edit_requested(self, msg: UserMessage.EditRequested) -> None:
        widgets = list(self.chat.query(UserMessage))
        if msg.message in widgets:
            await self.start_edit(widgets.index(msg.message))

    async def action_stop(self) -> None:
        """Esc: with nothing streaming, an edit in progress is cancelled (the box gets back what it held)."""
        busy = (self.current is not None and not self.current.finished) or self._compare_stop is not None
        if self.editing is not None and not busy:
            draft = self.editing.draft
            self.end_edit()
            self.prompt.set_text(draft)
            self.prompt.focus()
            self.notify("edit cancelled")
            return
        await super().action_stop()

    # -- commands and the palette --------------------------------------------------------
    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name in ("regen", "regenerate"):
            await self.action_regenerate()
        elif name == "edit":
            if arg and not (arg.isascii() and arg.isdigit() and int(arg) >= 1):
                await self.chat.add_notice(f"usage: /edit [N], N counting your messages from 1; got '{arg}'", "warning")
                return
            await self.start_edit(int(arg) - 1 if arg else None)
        else:
            await super().command(line)
