"""Conversation branches in the app: the part of :class:`~ssd_chat.tui.chat_view.ChatView` that shows
each message's place among its siblings ("‹ 2/3 ›") and switches between them (←/→ on a message
focused with Shift+Tab).

The saved chat is a tree (:mod:`ssd_chat.history.tree`): regenerate and edit add a sibling there
(:mod:`.rerun`) and nothing is dropped.  Switching makes the chosen sibling the chat's current branch in
the store, then shows that branch from the store and continues it: the next reply's context is the
branch on screen, and ``--resume`` opens it.
"""

from __future__ import annotations

from typing import Any

from ..history.store import HistoryError
from .replies import settle
from .widgets.chat_log import BranchStep

SHOWN = "UserMessage, AssistantMessage"


class BranchActions:
    """``self`` is the ChatView."""

    async def show_branches(self) -> None:
        """Label each message that has siblings with its place among them."""
        cid = self.conversation_id
        try:
            places = self.history.branches(cid) if cid is not None else {}
        except HistoryError:
            places = {}  # the chat still shows; only the labels are missing
        for w in self.chat.query(SHOWN):
            w.set_branch(places.get(w.message_id))

    async def on_branch_step(self, msg: BranchStep) -> None:
        msg.stop()
        w: Any = msg.widget
        if (self.current is not None and not self.current.finished) or self._compare_stop is not None:
            self.notify("a reply is still streaming — Esc stops it; then switch branches", severity="warning")
            return
        if self.editing is not None:
            await self.chat.add_notice("finish the edit first (Enter re-runs it, Esc cancels it)", "warning")
            return
        if await settle(self._reply_worker, 10):
            await self.chat.add_notice("the previous reply has not stopped yet; try again in a moment", "warning")
            return
        cid = self.conversation_id
        if cid is None or w.message_id is None or not w.branch:
            self.notify("this message has no other branches (F5 or an edit makes one)")
            return
        to = self.history.switch(cid, w.message_id, msg.by)
        if to is None:
            self.notify("no branch before this one" if msg.by < 0 else "no branch after this one")
            return
        try:
            saved = self.history.messages(cid)
        except HistoryError as e:
            await self.chat.add_notice(f"cannot show that branch: {e}", "error")
            return
        if next((m.id for m in saved if m.role == "user"), None) == to:  # the first prompt names the chat
            self.history.set_title(cid, saved[[m.id for m in saved].index(to)].content)
        await self.chat.clear()
        self.current = None
        self.session = self.new_session(None, [])
        await self.render_saved(saved, anchor=False)
        await self.check_history()
        shown = next((x for x in self.chat.query(SHOWN) if x.message_id == to), None)
        if shown is not None:
            shown.focus()
            self.call_after_refresh(shown.scroll_visible)
