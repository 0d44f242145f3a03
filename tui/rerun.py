"""Regenerate the last reply, and edit an earlier message and re-run the chat from it (:class:`Rerun`,
with the first-screen hint), and the branches they leave (:class:`Branches`).

Both replace the conversation from one of the user's messages on, on screen and in the session, then
send that message (edited or not) through :meth:`Replies.send <ssd_chat.tui.replies.Replies.send>`, so
the new reply streams, is measured and is saved like any other, with the settings in force now.  Nothing
is deleted: in the saved chat (a tree, :mod:`ssd_chat.history.tree`) the new message is a sibling of the
old one (regenerate: a new reply to the same question).  Each message with siblings shows its place
among them ("‹ 2/3 ›"); ←/→ on a message focused with Shift+Tab makes another sibling the chat's current
branch in the store, then shows that branch and continues it: the next reply's context is the branch on
screen, and ``--resume`` opens it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from textual.screen import ModalScreen
from textual.widgets import Static

from ..engine import SamplingParams
from ..history.store import LEAF, HistoryError
from .replies import Branch, settle
from .widgets.chat_log import AssistantMessage, BranchStep, UserMessage

HINT = ("Type a message and press Enter to send (Shift+Enter: new line) · /help lists the keys and commands · "
        "Ctrl+P opens the command palette")
SHOWN = "UserMessage, AssistantMessage"  # the messages that carry a branch label


@dataclass
class Editing:
    index: int  # which of the user's messages (0 = the first)
    session: Any  # the conversation it belongs to: a new chat or a resumed one ends the edit
    draft: str  # what was in the box before, put back when the edit is cancelled


class Rerun:
    """Regenerate and edit; ``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.editing: Editing | None = None

    async def refresh_hint(self) -> None:
        hints = list(self.view.chat.query(".hint"))  # the line an empty chat shows; it goes when the first message is sent
        empty = not self.view.chat.query(UserMessage)
        if empty and not hints:
            await self.view.chat.mount(Static(HINT, classes="hint", markup=False))
        elif not empty and hints:
            await self.view.chat.remove_children(hints)

    def edit_open(self, text: str) -> bool:
        """Whether ``text`` sent now re-runs the chat from the message being edited (a stale edit ends here)."""
        ed = self.editing
        if ed is None or text.startswith("/"):
            return False
        if ed.session is not self.ctl.session or ed.index >= len(self.view.chat.query(UserMessage)):
            self.end_edit()  # the chat it belonged to is gone: a plain message
        return self.editing is not None

    async def can_rerun(self) -> bool:
        """What :meth:`Replies.send` checks before it sends, checked before anything is cut."""
        c, chat = self.ctl, self.view.chat
        if c.backend.info().get("replay"):
            await chat.add_notice("a replayed session plays its recorded replies: it cannot regenerate or edit", "warning")
            return False
        if not c.ready:
            await chat.add_notice(c.load_error or "the model is still loading; try again when it is ready", "warning")
            return False
        if c.streaming():
            self.view.app.notify("a reply is still streaming — Esc stops it", severity="warning")
            return False
        if c.switching is not None:
            await chat.add_notice(f"still switching to {c.switching}; try again after that", "warning")
            return False
        try:
            SamplingParams(**c.params)
        except ValueError as e:
            await chat.add_notice(str(e), "error")
            return False
        if await settle(c.replies.worker, 10):  # a stopped reply enters the session when its thread ends
            await chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
            return False
        return True

    async def rerun_from(self, index: int, text: str, *, edited: bool) -> None:
        """Send ``text`` in place of the user's message ``index``: a new branch beside it in the saved chat
        (regenerate: a new reply beside the last one); on screen and in the session, the chat from there on
        is replaced by the new branch."""
        c, v = self.ctl, self.view
        users = [i for i, m in enumerate(c.session.messages) if m["role"] == "user"]
        widgets = list(v.chat.query(UserMessage))
        if index >= len(users) or len(widgets) != len(users):
            await v.chat.add_notice("this chat changed meanwhile; nothing was re-run", "warning")
            self.end_edit()
            return
        cut, question = users[index], widgets[index]
        later_system = [m["content"] for m in c.session.messages[cut:] if m["role"] == "system"] if not edited else []
        # a new reply to the same saved question, unless a system prompt set after the old reply must come first
        same_question = not edited and not later_system and question.message_id is not None
        children = list(v.chat.children)
        # on screen: from the message on (an edit), or that message and its reply (regenerate: later
        # notices, such as a settings change, stay; the question stays when it gets a new reply)
        start = children.index(question) + (1 if same_question else 0)
        end = len(children)
        if not edited:
            end = next((i + 1 for i in range(start, len(children)) if isinstance(children[i], AssistantMessage)), end)
        await v.chat.remove_children(children[start:end])
        c.current = None  # a late event of the dropped reply finds no turn to write into
        c.session.messages = c.session.messages[:cut]
        branch = Branch(user=question) if same_question else Branch(parent=self._parent_of(question))
        branch.regenerated = not edited
        for value in later_system:  # set after the reply regenerated: it applies from the message sent again
            c.session.set_system(value)
            branch.parent = c.history.add_message(c.conversation_id, "system", value, parent=branch.parent)
        draft = v.prompt.text  # regenerate leaves what is being typed in the box
        if edited:
            self.end_edit()
            if index == 0:  # the first prompt names the chat
                c.history.set_title(c.conversation_id, text)
            await v.chat.add_notice(f"re-running from your message {index + 1}, edited: the chat as it was "
                                    "stays as a branch (Shift+Tab to the message, ←/→ switch)")
        else:
            await v.chat.add_notice("regenerating the last reply with the current settings "
                                    "(the previous one stays as a branch: Shift+Tab to the reply, ←/→ switch)")
        await c.replies.send(text, branch)
        if not edited and draft.strip():
            v.prompt.set_text(draft)
        await self.refresh_hint()

    def _parent_of(self, question: UserMessage) -> Any:
        """The saved message the question follows (LEAF, the end of the branch, when it was never saved)."""
        if question.message_id is None or self.ctl.conversation_id is None:
            return LEAF
        try:
            return self.ctl.history.parent_of(question.message_id)
        except HistoryError:
            return LEAF

    async def regenerate(self) -> None:
        """F5 and /regen."""
        if isinstance(self.view.app.screen, ModalScreen):
            return  # F5 behind a dialog
        if self.editing is not None:
            await self.view.chat.add_notice("finish the edit first (Enter re-runs it, Esc cancels it)", "warning")
            return
        if not await self.can_rerun():
            return
        m = self.ctl.session.messages
        while m and m[-1]["role"] == "system":  # a system prompt set after the reply: the new one gets it
            m = m[:-1]
        if len(m) < 2 or m[-1]["role"] != "assistant" or m[-2]["role"] != "user":
            await self.view.chat.add_notice("no reply to regenerate yet", "warning")
            return
        await self.rerun_from(sum(x["role"] == "user" for x in m) - 1, m[-2]["content"], edited=False)

    async def start_edit(self, index: int | None = None) -> None:
        """Put the user's message ``index`` (None: the last) in the box; sending it re-runs the chat from there."""
        v = self.view
        texts = [w.text for w in v.chat.query(UserMessage)]
        if self.ctl.streaming():
            await v.chat.add_notice("stop the reply first (Esc), then edit", "warning")
            return
        if not texts:
            await v.chat.add_notice("nothing to edit yet: send a message first", "warning")
            return
        index = len(texts) - 1 if index is None else index
        if not 0 <= index < len(texts):
            await v.chat.add_notice(f"no message {index + 1}: this chat has {len(texts)} of yours (/edit 1 to /edit {len(texts)})", "warning")
            return
        draft = self.editing.draft if self.editing is not None else v.prompt.text
        self.editing = Editing(index, self.ctl.session, draft)
        v.prompt.set_text(texts[index])
        v.prompt.border_title = f"editing your message {index + 1} of {len(texts)} · Enter re-runs the chat from it · Esc cancels"
        v.prompt.focus()

    def end_edit(self) -> None:
        self.editing = None
        self.view.prompt.border_title = None


class Branches:
    """``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view

    async def show(self) -> None:
        """Label each message that has siblings with its place among them."""
        cid = self.ctl.conversation_id
        try:
            places = self.ctl.history.branches(cid) if cid is not None else {}
        except HistoryError:
            places = {}  # the chat still shows; only the labels are missing
        for w in self.view.chat.query(SHOWN):
            w.set_branch(places.get(w.message_id))

    async def step(self, msg: BranchStep) -> None:
        c, v = self.ctl, self.view
        w: Any = msg.widget
        if c.streaming() or c.compare.stop is not None:
            v.app.notify("a reply is still streaming — Esc stops it; then switch branches", severity="warning")
            return
        if c.rerun.editing is not None:
            await v.chat.add_notice("finish the edit first (Enter re-runs it, Esc cancels it)", "warning")
            return
        if await settle(c.replies.worker, 10):
            await v.chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
            return
        cid = c.conversation_id
        if cid is None or w.message_id is None or not w.branch:
            v.app.notify("this message has no other branches (F5 or an edit makes one)")
            return
        to = c.history.switch(cid, w.message_id, msg.by)
        if to is None:
            v.app.notify("no branch before this one" if msg.by < 0 else "no branch after this one")
            return
        try:
            saved = c.history.messages(cid)
        except HistoryError as e:
            await v.chat.add_notice(f"cannot show that branch: {e}", "error")
            return
        if next((m.id for m in saved if m.role == "user"), None) == to:  # the first prompt names the chat
            c.history.set_title(cid, saved[[m.id for m in saved].index(to)].content)
        await v.chat.clear()
        c.current = None
        c.session = c.new_session(None, [])
        await c.actions.render_saved(saved, anchor=False)
        await c.check_history()
        shown = next((x for x in v.chat.query(SHOWN) if x.message_id == to), None)
        if shown is not None:
            shown.focus()
            v.call_after_refresh(shown.scroll_visible)
