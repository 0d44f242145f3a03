"""Past chats: resume one (Enter) or delete it (d or Delete, then a confirmation naming the chat)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ...history.store import HistoryError
from ...chat.terminal import printable
from .confirm_dialog import ConfirmDialog


class ChatsDialog(ModalScreen[int | None]):
    """Returns the id of the chat to resume, or None."""

    @dataclass
    class Deleted(Message):
        """A saved chat was deleted (the app leaves it if it is the open one: its later turns would have no chat)."""

        conversation_id: int

    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("d,delete", "delete", "Delete")]

    def __init__(self, history) -> None:
        super().__init__()
        self.history = history
        self._convs: dict[int, object] = {}

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Chats — Enter resumes, d deletes (asks first), Esc closes", classes="dialog-title")
            yield OptionList(id="chat-list")
            yield Label("", id="chats-status", markup=False)

    def on_mount(self) -> None:
        self._fill()
        self.query_one(OptionList).focus()

    def _fill(self) -> None:
        ol = self.query_one(OptionList)
        at = ol.highlighted or 0
        ol.clear_options()
        try:
            convs = self.history.list_conversations()
        except HistoryError as e:  # shown in the dialog; the chat behind it goes on
            self.query_one("#chats-status", Label).update(printable(str(e)))
            return
        self._convs = {c.id: c for c in convs}
        for c in convs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
            # a title is what the user typed: plain text, never markup or escape sequences
            title = printable(c.title, one_line=True)
            ol.add_option(Option(Text(f"{c.id:>4}  {when}  {title}  ({c.num_messages} messages)"), id=str(c.id)))
        if not convs:
            self.query_one("#chats-status", Label).update("no saved chats yet")
        else:  # a chat is highlighted from the start: Enter and d act on it without an arrow key first
            ol.highlighted = min(at, len(convs) - 1)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_delete(self) -> None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return
        cid = int(ol.get_option_at_index(ol.highlighted).id)
        c = self._convs.get(cid)
        if c is None:
            return
        n = f"{c.num_messages} message{'' if c.num_messages == 1 else 's'}"

        def answered(yes: bool | None) -> None:
            if not yes:
                self.query_one("#chats-status", Label).update(f"kept chat {cid}")
                return
            deleted = self.history.delete_conversation(cid)
            if deleted:
                self.post_message(self.Deleted(cid))
            self.query_one("#chats-status", Label).update(f"deleted chat {cid}" if deleted else f"could not delete chat {cid}")
            self._fill()

        title = printable(c.title, one_line=True)
        self.app.push_screen(ConfirmDialog(f"Delete chat {cid}, “{title}” ({n})? This cannot be undone.", "Delete"), answered)
