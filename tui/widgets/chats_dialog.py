"""Past chats: resume one (Enter) or delete it (d, twice)."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from ...history import HistoryError
from ...terminal import printable


class ChatsDialog(ModalScreen[int | None]):
    """Returns the id of the chat to resume, or None."""

    BINDINGS = [Binding("escape", "cancel", "Close"), Binding("d", "delete", "Delete")]

    def __init__(self, history) -> None:
        super().__init__()
        self.history = history
        self._armed: int | None = None

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Chats — Enter resumes, d d deletes, Esc closes", classes="dialog-title")
            yield OptionList(id="chat-list")
            yield Label("", id="chats-status", markup=False)

    def on_mount(self) -> None:
        self._fill()
        self.query_one(OptionList).focus()

    def _fill(self) -> None:
        ol = self.query_one(OptionList)
        ol.clear_options()
        try:
            convs = self.history.list_conversations()
        except HistoryError as e:  # shown in the dialog; the chat behind it goes on
            self.query_one("#chats-status", Label).update(printable(str(e)))
            return
        for c in convs:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
            # a title is what the user typed: plain text, never markup or escape sequences
            title = printable(c.title, one_line=True)
            ol.add_option(Option(Text(f"{c.id:>4}  {when}  {title}  ({c.num_messages} messages)"), id=str(c.id)))
        if not convs:
            self.query_one("#chats-status", Label).update("no saved chats yet")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_delete(self) -> None:
        ol = self.query_one(OptionList)
        if ol.highlighted is None:
            return
        cid = int(ol.get_option_at_index(ol.highlighted).id)
        if self._armed != cid:
            self._armed = cid
            self.query_one("#chats-status", Label).update(f"press d again to delete chat {cid}")
            return
        self.history.delete_conversation(cid)
        self._armed = None
        self.query_one("#chats-status", Label).update(f"deleted chat {cid}")
        self._fill()
