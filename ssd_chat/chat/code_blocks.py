"""The fenced code blocks of a message, as a Markdown parser sees them (``c`` on a focused message, ``/save N FILE``)."""

from __future__ import annotations

from dataclasses import dataclass

from markdown_it import MarkdownIt


@dataclass(frozen=True)
class Block:
    lang: str  # the fence's info word ("python"), "" when it names none
    code: str  # the block's text, as a file would hold it (ends with a newline)

    @property
    def lines(self) -> int:
        return self.code.count("\n")

    def describe(self) -> str:
        return f"{self.lang or 'no language'}, {self.lines} line{'' if self.lines == 1 else 's'}"


def blocks(markdown: str) -> list[Block]:
    """Every fenced block of ``markdown`` in order (a fence still open at the end runs to the end, as shown)."""
    return [Block(t.info.split()[0] if t.info.strip() else "", t.content if t.content.endswith("\n") or not t.content else t.content + "\n")
            for t in MarkdownIt("commonmark").parse(markdown) if t.type == "fence"]
