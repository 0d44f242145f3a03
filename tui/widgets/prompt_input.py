"""The prompt box: Enter sends, Shift+Enter or Ctrl+J adds a line, Up/Down walk the prompt history, Tab
completes a model name after ``/model``.

Typed characters are inserted in batches: each TextArea edit re-wraps and re-measures the whole line,
so a long paste from a terminal without bracketed paste (every character a key event) cost O(length)
per key and froze the app.  A batch is inserted once the keys stop, or once it is an eighth of the text,
so a paste of n characters costs O(n) edits in all; while the text is short every key goes in at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.message import Message
from textual.widgets import TextArea


SHORT = 4096  # characters: below this every key goes into the box at once


class PromptInput(TextArea):
    """A multi-line prompt editor with a prompt history (most recent last)."""

    @dataclass
    class Submitted(Message):
        text: str

    @dataclass
    class Complete(Message):
        """Tab on a ``/model PREFIX`` line: the chat completes the name."""

        text: str

    def __init__(self, **kwargs) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, tab_behavior="focus", **kwargs)
        self.prompt_history: list[str] = []
        self._pos: int | None = None  # index into history while browsing
        self._draft = ""  # what was typed before browsing started
        self._typed: list[str] = []  # characters typed and not yet in the document
        self._typed_seen = 0  # len(_typed) at the last check: unchanged means the keys have stopped

    def flush_typed(self) -> None:
        """Insert the characters typed so far (readers of ``text`` call this first)."""
        if self._typed:
            typed, self._typed = "".join(self._typed), []
            self._replace_via_keyboard(typed, *self.selection)
            self.call_after_refresh(self.scroll_cursor_visible)  # once the box knows its new height

    def _check_typed(self) -> None:
        if not self._typed:
            return
        n = len(self._typed)
        if n == self._typed_seen or n * 8 >= len(self.document.text) or len(self.document.text) < SHORT:
            self.flush_typed()
            self._typed_seen = 0
        else:  # keys still arriving into a long text: look again shortly
            self._typed_seen = n
            self.set_timer(0.05, self._check_typed)

    def remember(self, text: str) -> None:
        if text and (not self.prompt_history or self.prompt_history[-1] != text):
            self.prompt_history.append(text)
        self._pos = None

    def set_text(self, text: str) -> None:
        self._typed.clear()  # keys typed before belonged to the text replaced
        self.text = text
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.is_printable and event.character and not self.read_only:
            event.stop()
            event.prevent_default()
            self._restart_blink()
            self._typed.append(event.character)
            if len(self._typed) == 1:
                self.call_later(self._check_typed)  # after the keys already queued for this box
            return
        self.flush_typed()  # the key acts after what was typed before it (Enter sends it all)
        if self._own_key(event.key):
            event.stop()
            event.prevent_default()
        else:
            await super()._on_key(event)

    def _own_key(self, key: str) -> bool:
        """Act on a key the box handles itself (Enter, Tab after ``/model``, new line, history); False for the rest."""
        if key == "enter":
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
        elif key == "tab" and self.text.startswith("/model ") and "\n" not in self.text:
            self.post_message(self.Complete(self.text))
        elif key in ("shift+enter", "ctrl+j", "alt+enter"):
            self._replace_via_keyboard("\n", *self.selection)
        elif key == "up" and self.cursor_location[0] == 0 and self.prompt_history:
            if self._pos is None:
                self._draft, self._pos = self.text, len(self.prompt_history)
            self._pos = max(0, self._pos - 1)
            self.set_text(self.prompt_history[self._pos])
        elif key == "down" and self._pos is not None and self.cursor_location[0] == self.document.line_count - 1:
            self._pos += 1
            if self._pos >= len(self.prompt_history):
                self._pos = None
            self.set_text(self._draft if self._pos is None else self.prompt_history[self._pos])
        else:
            return False
        return True
