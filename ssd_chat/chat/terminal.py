"""Text from the chat history on a terminal: what a user or a model wrote must not drive the terminal.

A stored prompt or reply can hold escape sequences (an OSC title change, a CSI cursor move, a bell);
printed raw, the terminal would obey them.  Control characters are shown as visible escapes
(``\\x1b``) instead, so the text is still all there to read.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from typing import TextIO

import typer

_KEEP = {"\n", "\t"}
# C0 controls, DEL and C1 controls (0x80-0x9f: a lone 0x9b is a CSI on many terminals)
_ESCAPES = {c: f"\\x{c:02x}" for c in [*range(0x20), 0x7F, *range(0x80, 0xA0)] if chr(c) not in _KEEP}


def printable(text: str, *, one_line: bool = False) -> str:
    """``text`` with control characters made visible; ``one_line`` also shows newlines and tabs escaped."""
    out = text.translate(_ESCAPES)
    return out.replace("\n", "\\n").replace("\t", "\\t") if one_line else out


def for_stream(text: str, stream: TextIO | None = None) -> str:
    """``text`` as it should be written to ``stream``: made printable on a terminal, unchanged into a
    file or a pipe (an export keeps the stored text exactly)."""
    return printable(text) if _tty(stream or sys.stdout) else text


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # not a file, or a closed one
        return False


def columns(stream: TextIO | None = None) -> int:
    """The width of the terminal ``stream`` writes to (stdout may be a pipe while stderr is the terminal)."""
    try:
        return os.get_terminal_size((stream or sys.stderr).fileno()).columns
    except (AttributeError, ValueError, OSError):
        return shutil.get_terminal_size().columns


def wrapped(message: str, stream: TextIO | None = None) -> str:
    """One logical message wrapped at the terminal's width, its continuation lines indented; unchanged
    into a file or a pipe, where a message stays one line for grep."""
    stream = stream or sys.stderr
    tty = _tty(stream)
    width = columns(stream) if tty else 0
    if not tty or len(message) <= width or width < 20:
        return message
    # a `command` stays on one line, so it can be copied whole
    kept = re.sub(r"`[^`]*`", lambda m: m.group(0).replace(" ", "\0"), message)
    return textwrap.fill(kept, width=width, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False).replace("\0", " ")


def fail(message: str | Exception, code: int | None = None) -> typer.Exit:
    """One line on stderr, and the exit to raise: usage errors 2, runtime failures 1.  Given an engine
    error and no code: 2 for a setting out of range (ParamError), else 1."""
    if code is None:
        from ..engine import ParamError

        code = 2 if isinstance(message, ParamError) else 1
    typer.echo(wrapped(f"ssd-chat: error: {message}", sys.stderr), err=True)
    return typer.Exit(code)
