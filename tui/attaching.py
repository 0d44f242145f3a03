"""Files into a prompt and code blocks out of a message (:class:`Attachments`): ``/attach``, ``c`` on a
focused message and ``/save``.

``/attach FILE`` stages a text file (read and counted now, with the target's tokenizer once it has
loaded); the next message sent carries it, as ``ask -a`` does (:mod:`ssd_chat.attach`), and the
saved chat keeps that full turn.  ``/attach`` lists what is staged and ``/attach clear`` drops it.
``c`` on a focused message copies its next fenced block; ``/save N FILE`` writes block N of the last
reply to a file, refusing to overwrite one unless ``--force`` is given.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from .. import attach
from ..code_blocks import blocks
from ..engine import threads
from ..terminal import printable
from .widgets.chat_log import CopyBlock

ATTACH_HELP = "/attach lists them, /attach clear drops them"
SAVE_USAGE = "usage: /save N FILE [--force] (block N of the last reply; /save alone lists its blocks)"


class Attachments:
    """``staged`` holds the files /attach staged for the next message, with their token counts; ``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.staged: list[tuple[Any, int | None]] = []

    # -- /attach -------------------------------------------------------------------------
    async def command(self, arg: str) -> None:
        chat = self.view.chat
        if not arg:
            if not self.staged:
                await chat.add_notice("nothing attached · /attach FILE puts a text file in your next message")
            else:
                await chat.add_notice(f"attached to your next message: {self._listed()} · /attach clear drops them")
            return
        if arg == "clear":
            n, self.staged = len(self.staged), []
            self._show_staged()
            await chat.add_notice(f"dropped {n} attached file{'' if n == 1 else 's'}" if n else "nothing was attached")
            return
        if len(arg) > 1 and arg[0] == arg[-1] and arg[0] in "'\"":
            arg = arg[1:-1]  # a quoted path
        try:
            a = attach.read(arg)
        except attach.AttachError as e:
            await chat.add_notice(str(e), "error")
            return
        backend = self.ctl.backend
        try:
            counted = await threads.in_thread(threads.count(), backend.count_tokens, a.block()) if self.ctl.ready else None
        except Exception:  # noqa: BLE001 - not counted: the reply's own context check still applies
            counted = None
        n, context = counted if counted is not None else (None, None)
        if n is not None:
            known = [(b, m) for b, m in self.staged if m is not None]
            try:
                attach.check_fits([*known, (a, n)], context, backend.info().get("target") or "the model")
            except attach.AttachError as e:
                await chat.add_notice(str(e), "error")
                return
        self.staged.append((a, n))
        self._show_staged()
        size = f"{n:,} tokens" if n is not None else f"{len(a.text):,} characters"
        await chat.add_notice(f"attached {a.shown} ({size}): it goes with your next message · {ATTACH_HELP}")

    def _listed(self) -> str:
        return ", ".join(f"{a.shown} ({n:,} tokens)" if n is not None else a.shown for a, n in self.staged)

    def _show_staged(self) -> None:
        """The chip under the prompt box: what the next message carries."""
        self.view.prompt.border_subtitle = f"attached: {', '.join(a.shown for a, _ in self.staged)}" if self.staged else None

    def take(self, text: str) -> str:
        """The turn to send for ``text``: the staged files, then the text; they are sent once."""
        if not self.staged:
            return text
        files, self.staged = [a for a, _ in self.staged], []
        self._show_staged()
        return attach.turn(files, text)

    # -- one code block at a time ------------------------------------------------------------
    def copy_block(self, msg: CopyBlock) -> None:
        w = msg.message
        found = blocks(w.text)
        if not found:
            self.view.notify("no code block in this message")
            return
        w.block_index = (w.block_index + 1) % len(found)
        b = found[w.block_index]
        self.ctl.actions.copy(b.code)
        self.view.notify(f"copied block {w.block_index + 1}/{len(found)} ({b.describe()})")

    async def save_block(self, arg: str) -> None:
        chat = self.view.chat
        reply = self.ctl.session.last("assistant")
        found = blocks(reply) if reply else []
        try:
            args = shlex.split(arg)
        except ValueError as e:
            await chat.add_notice(f"{SAVE_USAGE}: {e}", "warning")
            return
        force = "--force" in args
        args = [x for x in args if x != "--force"]
        if not args:
            listed = " · ".join(f"{i} {b.describe()}" for i, b in enumerate(found, 1))
            await chat.add_notice(f"the last reply's code blocks: {listed}" if found else "the last reply has no code block")
            return
        if len(args) != 2 or not (args[0].isascii() and args[0].isdigit()):
            await chat.add_notice(SAVE_USAGE, "warning")
            return
        n, path = int(args[0]), Path(args[1]).expanduser()
        if not found:
            await chat.add_notice("the last reply has no code block to save", "warning")
            return
        if not 1 <= n <= len(found):
            await chat.add_notice(f"no block {n}: the last reply has {len(found)} (/save 1 to /save {len(found)})", "warning")
            return
        b, shown = found[n - 1], printable(args[1], one_line=True)
        if path.is_dir():
            await chat.add_notice(f"cannot save to {shown}: it is a directory", "error")
            return
        if path.exists() and not force:
            await chat.add_notice(f"{shown} exists: add --force to overwrite it", "warning")
            return
        try:
            path.write_text(b.code, encoding="utf-8")
        except OSError as e:
            await chat.add_notice(f"cannot save to {shown}: {e.strerror or e}", "error")
            return
        await chat.add_notice(f"saved block {n}/{len(found)} ({b.describe()}) to {shown}")
