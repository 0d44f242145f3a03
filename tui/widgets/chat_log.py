"""The transcript: user prompts, streaming assistant replies (Markdown), notices.

Everything shown here was written by the user or a model: it is shown as plain text (``Text``,
``markup=False``) with control characters made visible (:func:`printable`), so neither Textual
markup nor a terminal escape sequence in it is obeyed.  The widgets keep the text itself unchanged.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from markdown_it import MarkdownIt
from rich.text import Text
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from ...chat.terminal import printable
from .coloured import coloured


@functools.cache
def _parser() -> MarkdownIt:
    """One parser for every reply: Textual builds a new ``MarkdownIt`` (compiling linkify's patterns) for
    each streamed append otherwise, a tenth of the UI thread's time while a reply streams."""
    return MarkdownIt("gfm-like")

# token colouring (off by default): accepted draft tokens vs the target's own (bonus / AR) tokens
DRAFT_STYLE = "green"
TARGET_STYLE = "bold yellow"  # drawn orange: the app's dark theme maps ANSI yellow to orange (the docs say orange)


@dataclass
class CopyBlock(Message):
    """``c`` on a focused message: copy its next fenced code block (the chat keeps which one was last)."""

    message: UserMessage | AssistantMessage


@dataclass
class BranchStep(Message):
    """←/→ on a focused message: show its sibling ``by`` places away (another edit or regenerated reply)."""

    widget: UserMessage | AssistantMessage
    by: int


BRANCH_KEYS = [Binding("left", "branch(-1)", "Previous branch"), Binding("right", "branch(1)", "Next branch")]
COPY_KEY = Binding("c", "copy_block", "Copy code block")


def branch_label(place: tuple[int, int] | None) -> str:
    return f"‹ {place[0]}/{place[1]} ›" if place else ""


class InTranscriptOrder(Widget):
    """A message, with the keys both kinds share (←/→, c), focused in the transcript's order.  Textual sorts focusable
    siblings by where they are on screen, and a message before its first layout has an empty region at the top:
    Shift+Tab right after a reply ended skipped it.  Messages are only appended, so one not laid out yet sorts last
    (ties keep the DOM order)."""

    block_index = -1  # the block c copied last
    message_id: int | None = None  # the saved message (ssd_chat/history/tree.py)
    branch = ""  # its place among its siblings, "‹ 2/3 ›" ("": none)

    @property
    def _focus_sort_key(self) -> tuple[float, float]:
        return super()._focus_sort_key if self.virtual_region else (math.inf, 0)

    def action_branch(self, by: int) -> None:
        self.post_message(BranchStep(self, by))

    def action_copy_block(self) -> None:
        self.post_message(CopyBlock(self))


class UserMessage(InTranscriptOrder, Static, can_focus=True):
    """A prompt as the user wrote it (plain text: no Markdown surprises).  Focusable (Shift+Tab from the
    prompt box, or a click): e or Enter puts it back in the box to edit and re-run from there; ←/→ switch
    to its siblings (its other edits), whose place shows as "‹ 2/3 ›" before the text; c copies its next
    code block (an attached file)."""

    BINDINGS = [Binding("e,enter", "edit", "Edit and re-run"), *BRANCH_KEYS, COPY_KEY]

    @dataclass
    class EditRequested(Message):
        message: UserMessage

    def __init__(self, text: str) -> None:
        super().__init__(Text(printable(text)), classes="message user", markup=False)
        self.text = text

    def set_branch(self, place: tuple[int, int] | None) -> None:
        self.branch = branch_label(place)
        shown = Text(printable(self.text))
        self.update(Text.assemble((self.branch + " ", "bold"), shown) if self.branch else shown)

    def action_edit(self) -> None:
        self.post_message(self.EditRequested(self))


class Notice(Static):
    """A line from the app (warnings, errors, settings changes)."""

    def __init__(self, text: str, level: str = "info") -> None:
        super().__init__(Text(printable(text)), classes=f"notice -{level}", markup=False)
        self.text = text


class AssistantMessage(InTranscriptOrder, Vertical, can_focus=True):
    """A reply: Markdown while streaming (coalesced through a MarkdownStream), a status line at the end, and
    ``segments`` (each token's text and source) for the view coloured by token (``-colour``).  Focusable (Shift+Tab,
    a click): ←/→ switch to the replies regenerated beside it, its place shown as "‹ 2/3 ›" above it; c copies its
    next fenced code block, cycling through them."""

    DEFAULT_CLASSES = "message assistant"
    BINDINGS = [*BRANCH_KEYS, COPY_KEY]

    def __init__(self, text: str = "", status: str = "streaming", meta: str = "", colour: bool = False) -> None:
        super().__init__()
        self.text = text
        self.status = status
        self.segments: list[tuple[str, str]] = [(text, "target")] if text else []
        self._meta_text = meta
        self._stream: MarkdownStream | None = None
        self._body = Markdown(printable(text), classes="body", parser_factory=_parser)
        self._colour_view = Static(self._coloured(), classes="coloured", markup=False)
        self._meta = Static(Text(printable(meta)), classes="meta", markup=False)
        self._branch = Static("", classes="branch", markup=False)
        self._branch.display = False
        self.set_class(colour, "-colour")
        self.set_class(status == "streaming", "-streaming")

    def compose(self):
        yield self._branch
        yield self._body
        yield self._colour_view
        yield self._meta

    def _coloured(self) -> Text:
        """The reply's Markdown rendered, each character in its token's colour (:mod:`..coloured`)."""
        return coloured(self.segments, lambda source: DRAFT_STYLE if source == "draft" else TARGET_STYLE, _parser())

    @property
    def body(self) -> Markdown:
        return self._body

    async def append(self, pieces: list[tuple[str, str]]) -> None:
        """Add streamed token texts ``[(text, source), ...]`` (one call per UI frame)."""
        delta = "".join(t for t, _ in pieces)
        self.segments.extend(pieces)
        if not delta:
            return
        self.text += delta
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
        await self._stream.write(printable(delta))
        if self.has_class("-colour"):
            self._colour_view.update(self._coloured())

    async def finish(self, text: str, status: str, meta: str = "") -> None:
        """The reply ended: show the authoritative full text once, and its status line."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if text.startswith(self.text) and len(text) > len(self.text):
            self.segments.append((text[len(self.text):], "target"))  # held back for stop-string matching
        elif text != self.text:
            self.segments = [(text, "target")]
        self.text = text
        self.status = status
        await self.body.update(printable(text))
        self._colour_view.update(self._coloured())
        self._meta_text = meta
        self._meta.update(Text(printable(meta)))
        self.remove_class("-streaming")
        self.set_class(status != "done", f"-{status}")

    def set_branch(self, place: tuple[int, int] | None) -> None:
        self.branch = branch_label(place)
        self._branch.update(self.branch)
        self._branch.display = bool(self.branch)

    def set_colour(self, on: bool) -> None:
        self.set_class(on, "-colour")
        if on:
            self._colour_view.update(self._coloured())


class ChatLog(VerticalScroll):
    """The scrolling transcript; it follows new text unless the user has scrolled up."""

    def on_mount(self) -> None:
        self.anchor()

    async def _add(self, w: Any, before: Widget | None = None) -> Any:
        await self.mount(w, before=before)
        return w

    async def add_user(self, text: str) -> UserMessage:
        return await self._add(UserMessage(text))

    async def add_assistant(self, text: str = "", status: str = "streaming", meta: str = "", colour: bool = False) -> AssistantMessage:
        return await self._add(AssistantMessage(text, status, meta, colour))

    async def add_notice(self, text: str, level: str = "info", before: Widget | None = None) -> Notice:
        """A notice at the end of the chat, or above ``before`` (a streaming reply's notice, above the reply)."""
        return await self._add(Notice(text, level), before if before is not None and before.parent is self else None)

    async def clear(self) -> None:
        await self.remove_children()

    def set_colour(self, on: bool) -> None:
        for m in self.query(AssistantMessage):
            m.set_colour(on)
