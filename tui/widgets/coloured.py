"""A reply's token-coloured view (Ctrl+T): its Markdown rendered as styled text, each character in the
colour of the token it came from.

The reply is parsed with the transcript's Markdown parser; the text of each parsed element is found
again in the reply, in order, so a character keeps its token's colour while the markup around it
(``**``, ``#``, backticks, list markers, link targets) is shown as Markdown shows it: bold, italic, a
heading, a bullet.  Every character comes from the reply made :func:`printable` first, or from this
module (bullets, separators): a control character shows as ``\\x1b``, and a ``Text`` obeys no markup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from markdown_it import MarkdownIt
from markdown_it.token import Token
from rich.style import Style
from rich.text import Text

from ...chat.terminal import printable

WINDOW = 16  # a character rewritten by the parser (an entity, an escape) is looked for this far ahead
EMPHASIS = {"strong": Style(bold=True), "em": Style(italic=True), "s": Style(strike=True), "link": Style(underline=True)}
CODE = Style(bgcolor="grey23")
HEADING = Style(bold=True, underline=True)


class _Renderer:
    def __init__(self, source: str, styles: list[Style]) -> None:
        self.source, self.styles = source, styles
        self.cursor = 0
        self.out: list[tuple[str, Style | None]] = []
        self.extra: list[Style] = []  # emphasis in force (bold inside a heading inside ...)
        self.lists = 0  # lists open (nested lists are indented)
        self.quote = 0

    def emit(self, text: str, style: Style | None = None) -> None:
        """Characters of the layout (bullets, line breaks): not from the reply, not coloured."""
        self.out.extend((ch, style) for ch in text)

    def _style(self, at: int) -> Style:
        base = self.styles[min(at, len(self.styles) - 1)] if self.styles else Style()
        return Style.chain(base, *self.extra) if self.extra else base

    def take(self, content: str, extra: Style | None = None) -> None:
        """``content`` as the parser gives it, each character in the colour of where it is in the reply."""
        if extra is not None:
            self.extra.append(extra)
        at = self.source.find(content, self.cursor) if content else -1
        if at >= 0:
            self.out.extend((ch, self._style(at + i)) for i, ch in enumerate(content))
            self.cursor = at + len(content)
        else:  # rewritten by the parser (``&amp;``, ``\\*``, an indented code block's lines): one at a time
            for ch in content:
                q = self.source.find(ch, self.cursor, self.cursor + WINDOW)
                self.out.append((ch, self._style(q if q >= 0 else self.cursor)))
                if q >= 0:
                    self.cursor = q + 1
        if extra is not None:
            self.extra.pop()

    def block_end(self) -> None:
        """A paragraph, heading or list ends: one line in a list, a blank line elsewhere."""
        while self.out and self.out[-1][0] == " ":
            self.out.pop()
        self.emit("\n" if self.lists else "\n\n")

    def inline(self, children: Iterable[Token]) -> None:
        for c in children:
            kind = c.type
            if kind.endswith("_open") and kind[:-5] in EMPHASIS:
                self.extra.append(EMPHASIS[kind[:-5]])
            elif kind.endswith("_close") and kind[:-6] in EMPHASIS:
                if self.extra:
                    self.extra.pop()
            elif kind == "softbreak":
                self.emit(" ")
            elif kind == "hardbreak":
                self.emit("\n")
            elif kind == "code_inline":
                self.take(c.content, CODE)
            elif c.children:  # an image: its alt text
                self.inline(c.children)
            elif c.content:  # text, inline HTML: shown as written
                self.take(c.content)

    def blocks(self, tokens: list[Token]) -> None:
        for t in tokens:
            kind = t.type
            if kind == "heading_open":
                self.extra.append(HEADING)
            elif kind == "heading_close":
                self.extra.pop()
                self.block_end()
            elif kind == "paragraph_open" and self.quote and not t.hidden:
                self.emit("▌ " * self.quote, Style(dim=True))
            elif kind == "paragraph_close":
                self.block_end()
            elif kind in ("bullet_list_open", "ordered_list_open"):
                self.lists += 1
            elif kind in ("bullet_list_close", "ordered_list_close"):
                self.lists -= 1
                if not self.lists:
                    self.emit("\n")
            elif kind == "list_item_open":  # the marker in its token's colour: "3." as written, "-" or "*" as "•"
                self.emit("  " * (self.lists - 1))
                if t.info:
                    self.take(t.info + t.markup)
                else:
                    at = self.source.find(t.markup, self.cursor)
                    self.out.append(("•", self._style(at if at >= 0 else self.cursor)))
                    self.cursor = at + 1 if at >= 0 else self.cursor
                self.emit(" ")
            elif kind == "blockquote_open":
                self.quote += 1
            elif kind == "blockquote_close":
                self.quote -= 1
            elif kind in ("fence", "code_block", "html_block"):  # HTML shown as written, not as code
                self.take(t.content.rstrip("\n"), None if kind == "html_block" else CODE)
                self.block_end()
            elif kind == "hr":
                self.emit("───")
                self.block_end()
            elif kind in ("th_open", "td_open") and self.out and self.out[-1][0] != "\n":
                self.emit(" │ ", Style(dim=True))
            elif kind in ("tr_close", "table_close"):
                self.emit("\n")
            elif kind == "inline":
                self.inline(t.children or [])

    def text(self) -> Text:
        while self.out and self.out[-1][0] in "\n ":
            self.out.pop()
        text = Text()
        run, style = "", None
        for ch, s in self.out:  # runs of one style: one span each
            if s != style and run:
                text.append(run, style)
                run = ""
            run, style = run + ch, s
        if run:
            text.append(run, style)
        return text


def coloured(segments: Iterable[tuple[str, str]], style_of: Callable[[str], str], parser: MarkdownIt) -> Text:
    """``segments`` (token text, source) rendered from Markdown, each character in ``style_of(source)``."""
    source: list[str] = []
    styles: list[Style] = []
    parsed: dict[str, Style] = {}
    for text, who in segments:
        shown = printable(text)
        source.append(shown)
        styles.extend([parsed.setdefault(who, Style.parse(style_of(who)))] * len(shown))
    r = _Renderer("".join(source), styles)
    r.blocks(parser.parse(r.source))
    return r.text()
