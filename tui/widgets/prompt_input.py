"""The prompt box: Enter sends, Shift+Enter or Ctrl+J adds a line, Up/Down walk the prompt history."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    """A multi-line prompt editor with a prompt history (most recent last)."""

    @dataclass
    class Submitted(Message):
        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompt_history: list[str] = []
        self._pos: int | None = None  # index into history while browsing
        self._draft = ""  # what was typed before browsing started

    def remember(self, text: str) -> None:
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._pos = None

    def set_text(self, text: str) -> None:
        self.text = text
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        key = event.key
        if key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text
            if text.strip():
                self.post_message(self.Submitted(text))
            return
        if key in ("shift+enter", "ctrl+j", "alt+enter"):
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        if key == "up" and self.cursor_location[0] == 0 and self.prompt_history:
            event.stop()
            event.prevent_default()
            if self._pos is None:
                self._draft, self._pos = self.text, len(self.prompt_history)
            self._pos = max(0, self._pos - 1)
            self.set_text(self.prompt_history[self._pos])
            return
        if key == "down" and self._pos is not None and self.cursor_location[0] == self.document.line_count - 1:
            event.stop()
            event.prevent_default()
            self._pos += 1
            if self._pos >= len(self.prompt_history):
                self._pos = None
                self.set_text(self._draft)
            else:
                self.set_text(self.prompt_history[self._pos])
            return
        await super()._on_key(event)
