"""Files into a prompt and code blocks out of a message: the part of :class:`~ssd_chat.tui.chat_view.ChatView`
behind ``/attach``, ``c`` on a focused message and ``/save``.

``/attach FILE`` stages a text file (read and counted now, with the target's tokenizer once it has
loaded); the next message sent carries it, as ``ask -a`` does (:mod:`ssd_chat.chat.attach`), and the
saved chat keeps that full turn.  ``/attach`` lists what is staged and ``/attach clear`` drops it.
``c`` on a focused message copies its next fenced block; ``/save N FILE`` writes block N of the last
reply to a file, refusing to overwrite one unless ``--force`` is given.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from ..chat import attach
from ..chat.code_blocks import blocks
from ..engine import threads
from ..chat.terminal import printable
from .widgets.chat_log import CopyBlock

ATTACH_HELP = "/attach lists them, /attach clear drops them"
SAVE_USAGE = "usage: /save N FILE [--force] (block N of the last reply; /save alone lists its blocks)"


class AttachActions:
    """``self`` is the ChatView; ``self.attachments`` holds the staged files with their token counts."""

    # -- /attach -------------------------------------------------------------------------
    async def attach(self, arg: str) -> None:
        if not arg:
            if not self.attachments:
                await self.chat.add_notice("nothing attached · /attach FILE puts a text file in your next message")
            else:
                await self.chat.add_notice(f"attached to your next message: {self._staged()} · /attach clear drops them")
            return
        if arg == "clear":
            n, self.attachments = len(self.attachments), []
            self._show_staged()
            await self.chat.add_notice(f"dropped {n} attached file{'' if n == 1 else 's'}" if n else "nothing was attached")
            return
        if len(arg) > 1 and arg[0] == arg[-1] and arg[0] in "'\"":
            arg = arg[1:-1]  # a quoted path
        try:
            a = attach.read(arg)
        except attach.AttachError as e:
            await self.chat.add_notice(str(e), "error")
            return
        try:
            counted = await threads.in_thread(threads.count(), self.backend.count_tokens, a.block()) if self.ready else None
        except Exception:  # noqa: BLE001 - not counted: the reply's own context check still applies
            counted = None
        n, context = counted if counted is not None else (None, None)
        if n is not None:
            known = [(b, m) for b, m in self.attachments if m is not None]
            try:
                attach.check_fits([*known, (a, n)], context, self.backend.info().get("target") or "the model")
            except attach.AttachError as e:
                await self.chat.add_notice(str(e), "error")
                return
        self.attachments.append((a, n))
        self._show_staged()
        size = f"{n:,} tokens" if n is not None else f"{len(a.text):,} characters"
        await self.chat.add_notice(f"attached {a.shown} ({size}): it goes with your next message · {ATTACH_HELP}")

    def _staged(self) -> str:
        return ", ".join(f"{a.shown} ({n:,} tokens)" if n is not None else a.shown for a, n in self.attachments)

    def _show_staged(self) -> None:
        """The chip under the prompt box: what the next message carries."""
        self.prompt.border_subtitle = f"attached: {', '.join(a.shown for a, _ in self.attachments)}" if self.attachments else None

    def take_attachments(self, text: str) -> str:
        """The turn to send for ``text``: the staged files, then the text; they are sent once."""
        if not self.attachments:
            return text
        files, self.attachments = [a for a, _ in self.attachments], []
        self._show_staged()
        return attach.turn(files, text)

    # -- one code block at a time ------------------------------------------------------------
    async def on_copy_block(self, msg: CopyBlock) -> None:
        w = msg.message
        found = blocks(w.text)
        if not found:
            self.notify("no code block in this message")
            return
        w.block_index = (w.block_index + 1) % len(found)
        b = found[w.block_index]
        self.clipboard_text = b.code
        self.app.copy_to_clipboard(b.code)
        self.notify(f"copied block {w.block_index + 1}/{len(found)} ({b.describe()})")

    async def save_block(self, arg: str) -> None:
        reply = self.last_reply()
        found = blocks(reply) if reply else []
        try:
            args = shlex.split(arg)
        except ValueError as e:
            await self.chat.add_notice(f"{SAVE_USAGE}: {e}", "warning")
            return
        force = "--force" in args
        args = [x for x in args if x != "--force"]
        if not args:
            listed = " · ".join(f"{i} {b.describe()}" for i, b in enumerate(found, 1))
            await self.chat.add_notice(f"the last reply's code blocks: {listed}" if found else "the last reply has no code block")
            return
        if len(args) != 2 or not (args[0].isascii() and args[0].isdigit()):
            await self.chat.add_notice(SAVE_USAGE, "warning")
            return
        n, path = int(args[0]), Path(args[1]).expanduser()
        if not found:
            await self.chat.add_notice("the last reply has no code block to save", "warning")
            return
        if not 1 <= n <= len(found):
            await self.chat.add_notice(f"no block {n}: the last reply has {len(found)} (/save 1 to /save {len(found)})", "warning")
            return
        b, shown = found[n - 1], printable(args[1], one_line=True)
        if path.is_dir():
            await self.chat.add_notice(f"cannot save to {shown}: it is a directory", "error")
            return
        if path.exists() and not force:
            await self.chat.add_notice(f"{shown} exists: add --force to overwrite it", "warning")
            return
        try:
            path.write_text(b.code, encoding="utf-8")
        except OSError as e:
            await self.chat.add_notice(f"cannot save to {shown}: {e.strerror or e}", "error")
            return
        await self.chat.add_notice(f"saved block {n}/{len(found)} ({b.describe()}) to {shown}")

    # -- commands ------------------------------------------------------------------------
    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        if name == "attach":
            await self.attach(arg)
        elif name == "save":
            await self.save_block(arg)
        else:
            await super().command(line)
