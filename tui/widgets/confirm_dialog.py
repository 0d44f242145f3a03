"""A yes/no question before something that cannot be undone (deleting a saved chat)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmDialog(ModalScreen[bool]):
    """Returns True when confirmed (y, Enter on the focused confirm button), False when cancelled (n, Esc)."""

    BINDINGS = [Binding("y", "dismiss(True)", "Yes"), Binding("n,escape", "dismiss(False)", "No")]

    def __init__(self, question: str, confirm: str = "Yes") -> None:
        super().__init__()
        self.question, self.confirm = question, confirm

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog confirm"):
            # the question quotes titles the user typed: plain text, no markup
            yield Label(self.question, id="confirm-question", markup=False)
            yield Label("Enter or y confirms, Esc or n cancels", classes="confirm-keys")
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.confirm, variant="error", id="confirm")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#confirm", Button).focus()  # Enter presses it

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm")
