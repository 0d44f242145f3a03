"""Edit the system prompt (applies from the next reply)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, TextArea


class SystemPromptDialog(ModalScreen[str | None]):
    """Returns the new system prompt ("" clears it), or None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, current: str | None) -> None:
        super().__init__()
        self.current = current or ""

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("System prompt (empty: none) — Ctrl+S saves, Esc cancels", classes="dialog-title")
            yield TextArea(self.current, id="system-text", soft_wrap=True)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_save(self) -> None:
        self.dismiss(self.query_one("#system-text", TextArea).text.strip())

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.dismiss(None)
