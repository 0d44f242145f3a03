"""Between-reply actions of the chat, called by its controller (which dispatches the slash commands); the app
opens the dialogs that lead here.

:class:`ChatActions`: new chat, copy, system prompt, settings (without reloading models), resuming and exporting
saved chats, token colours.  :class:`Attachments`: files into the next message (``/attach``, as ``ask -a`` does:
:mod:`ssd_chat.chat.attach`; the saved chat keeps that full turn) and code blocks out (``c``, ``/save``).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..chat import attach
from ..chat.backend import readable
from ..chat.code_blocks import blocks
from ..chat.settings import SAMPLING_KEYS
from ..engine import threads
from ..history.store import HistoryError, data_dir, metrics_line
from ..chat.changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings
from ..chat.terminal import printable
from .widgets.chat_log import CopyBlock


HELP = """Keys: Enter send · Shift+Enter / Ctrl+J new line · ↑/↓ prompt history · Esc stop the reply ·
Ctrl+N new chat · Ctrl+Y copy last reply · Ctrl+S system prompt · Ctrl+O settings (mode, k, fan-out, sampling, length) ·
F5 regenerate the last reply · Shift+Tab to one of your messages, then e: edit it and re-run the chat from there ·
Shift+Tab to a message, then ←/→: switch between its branches (F5 and edits keep the old one as a branch) ·
Shift+Tab to a message, then c: copy its next code block (again: the one after) ·
Ctrl+G compare (the prompt in the box, or the last one, in AR, SD and SSD: tok/s and identical outputs) ·
Ctrl+R chats · Ctrl+T token colours · Ctrl+P command palette · Ctrl+C quit.
Commands: /mode ar|sd|ssd|auto · /k N · /fan-out SPEC · /temp X · /top-p X · /top-k N · /seed N · /repeat-penalty X · /max N · /system TEXT ·
/compare [PROMPT] · /regen · /edit [N] (your Nth message; none: the last) · /new · /copy · /chats · /colour · /help ·
/attach FILE (a text file into your next message; /attach lists, /attach clear drops) · /save N FILE [--force] (block N of the last reply) ·
/model [NAME] (the local models; NAME: the target for the next chat, Tab completes it)"""


def system_notice(value: str | None) -> str:
    return f"system prompt from here on: {value}" if value else "system prompt cleared from here on"


class ChatActions:
    """Actions between replies; ``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.clipboard_text: str | None = None

    async def clear(self) -> None:
        """An empty transcript, panel and cache view, and no reply in progress (a new or a resumed chat)."""
        await self.view.chat.clear()
        self.ctl.current = None
        self.view.panel.reset()
        self.view.panel.forget_replies()
        self.view.cache.clear()

    def copy_reply(self) -> None:
        text = self.ctl.session.last("assistant")
        if text is None:
            self.view.app.notify("no reply to copy yet")
            return
        self.copy(text, f"the last reply ({len(text)} characters)")

    def copy(self, text: str, what: str) -> None:
        self.clipboard_text = text
        self.view.app.copy_to_clipboard(text)
        self.view.app.notify(f"copied {what}")

    async def set_system(self, value: str) -> None:
        """A system prompt for the replies from here on: a message at this point of the chat, saved as one
        (the replies before it did not see it, and a resumed chat or an export shows it here)."""
        c = self.ctl
        if (value or None) == c.system:
            self.view.app.notify("the system prompt is unchanged")
            return
        if c.conversation_id is None and all(m["role"] == "system" for m in c.session.messages):
            c.session.messages = [{"role": "system", "content": value}] if value else []  # nothing said yet: the start's
        else:
            c.session.set_system(value)
            c.history.set_system(c.conversation_id, value)
        await self.view.chat.add_notice(system_notice(value))

    async def apply_settings(self, changes: dict[str, Any]) -> bool:
        """Apply mode / k / fan-out (engine, no reload) and sampling settings from the next reply on.
        While the model loads they are remembered and applied once it is ready (:meth:`apply_pending`)."""
        c, chat = self.ctl, self.view.chat
        desc = ", ".join(f"{k.replace('_', '-')} {v if v is not None else 'default'}" for k, v in changes.items())
        if not c.ready:
            if c.load_error:
                await chat.add_notice("settings cannot change: the model did not load (Ctrl+C quits)", "warning")
                return False
            c.pending_settings.update(changes)
            # a toast: the chat gets the lasting notice when the setting applies (apply_pending)
            self.view.app.notify(f"the model is still loading; {desc} will apply once it is ready")
            return True
        if c.streaming():
            await chat.add_notice("settings change between replies: stop this one first (Esc)", "warning")
            return False
        engine_changes = {k: v for k, v in changes.items() if k in ENGINE_CHANGES}
        if engine_changes:
            if c.switching is not None:
                await chat.add_notice(f"still switching to {c.switching}; change settings after that", "warning")
                return False
            c.switching = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in engine_changes.items())
            try:
                await threads.in_thread(threads.count(), c.backend.reconfigure, **engine_changes)  # may derive a draft (seconds)
            except Exception as e:  # noqa: BLE001 - shown, the old settings stay
                await chat.add_notice(f"cannot change {', '.join(engine_changes)}: {readable(e)}", "error")
                return False
            finally:
                c.switching = None
            c.engine_changes.update(engine_changes)
        c.params.update({k: v for k, v in changes.items() if k in SAMPLING_KEYS})
        c.update_info()
        if changes.get("mode") == "auto":  # what auto chose here, and why (the panel's why line)
            info = c.backend.info()
            desc = desc.replace("mode auto", f"mode auto ({(info.get('mode') or '?').upper()} on this machine)", 1)
            if info.get("mode_reason"):
                desc += f" — {info['mode_reason']}"
        await chat.add_notice(f"from the next reply: {desc}")
        return True

    async def apply_pending(self) -> None:
        """The settings changed while the model loaded, now that it is ready."""
        changes, self.ctl.pending_settings = self.ctl.pending_settings, {}
        self.ctl.switching = None  # apply_settings takes it over before its first await
        await self.apply_settings(changes)

    async def settings_command(self, name: str, arg: str) -> None:
        if not arg and SLASH_KEYS[name] != "fan_out":
            await self.view.chat.add_notice(f"usage: /{name} VALUE", "warning")
            return
        try:
            changes = parse_settings({SLASH_KEYS[name]: arg})
        except ValueError as e:
            await self.view.chat.add_notice(str(e), "error")
            return
        await self.apply_settings(changes)

    async def resume(self, conversation_id: int) -> bool:
        """Show a saved chat and continue it."""
        c, v = self.ctl, self.view
        if c.streaming():
            await v.chat.add_notice("stop the reply first (Esc)", "warning")
            return False
        try:  # read it all before changing anything: a damaged chat leaves the current one as it was
            conv = c.history.get_conversation(conversation_id)
            saved = c.history.messages(conversation_id) if conv is not None else []
        except HistoryError as e:
            await v.chat.add_notice(f"cannot resume: {e}", "error")
            return False
        if conv is None:
            await v.chat.add_notice(f"no saved chat with id {conversation_id} (see `ssd-chat chats list`)", "error")
            return False
        await self.clear()
        c.conversation_id, c.session = conv.id, c.new_session(None, [])
        await v.chat.add_notice(f"resumed chat {conv.id}: {conv.title}")
        await self.render_saved(saved)
        return True

    async def render_saved(self, saved: list[Any], anchor: bool = True) -> None:
        """Show saved messages (a chat's current branch) and continue the session from them."""
        c, chat = self.ctl, self.view.chat
        for m in saved:
            if m.role == "system":  # where it was set: the replies above it did not see it
                await chat.add_notice(system_notice(m.content))
            elif m.role == "user":
                w = await chat.add_user(m.content)
            elif m.role == "assistant":
                status = "stopped" if m.status == "streaming" else m.status  # "streaming": the app died mid-reply
                meta = (metrics_line(m.metrics) if m.metrics else "") + ("" if status == "done" else f" · {status}")
                w = await chat.add_assistant(m.content, status, meta, c.colour)  # never "streaming": no -streaming class
            else:
                continue
            if m.role != "system":
                w.message_id = m.id
            c.session.messages.append({"role": m.role, "content": m.content})
        if anchor:
            chat.anchor()
        await c.branches.show()

    def export_chat(self, fmt: str = "md") -> Path | None:
        """Write this chat with its metrics to ``<data dir>/exports/chat-<id>.<md|jsonl>``; returns the path."""
        cid, v = self.ctl.conversation_id, self.view
        if cid is None:
            v.app.notify("nothing to export yet", severity="warning")
            return None
        try:
            text = self.ctl.history.export(cid, "jsonl" if fmt == "jsonl" else "md")
            out = data_dir() / "exports" / f"chat-{cid}.{fmt}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except (KeyError, OSError, HistoryError) as e:
            v.app.notify(f"could not export: {e}", severity="error")
            return None
        v.app.notify(f"exported to {out}")
        return out

    def toggle_colour(self) -> None:
        c = self.ctl
        c.colour = not c.colour
        self.view.chat.set_colour(c.colour)
        self.view.app.notify("token colours " + ("on: green = accepted draft tokens, orange = target (bonus) tokens" if c.colour else "off"))


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
            await chat.add_notice(f"attached to your next message: {self._listed()} · /attach clear drops them" if self.staged
                                  else "nothing attached · /attach FILE puts a text file in your next message")
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
        try:
            counted = await threads.in_thread(threads.count(), self.ctl.backend.count_tokens, a.block()) if self.ctl.ready else None
        except Exception:  # noqa: BLE001 - not counted: the reply's own context check still applies
            counted = None
        n, context = counted if counted is not None else (None, None)
        if n is not None:
            known = [(b, m) for b, m in self.staged if m is not None]
            try:
                attach.check_fits([*known, (a, n)], context, self.ctl.backend.info().get("target") or "the model")
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
            self.view.app.notify("no code block in this message")
            return
        w.block_index = (w.block_index + 1) % len(found)
        b = found[w.block_index]
        self.ctl.actions.copy(b.code, f"block {w.block_index + 1}/{len(found)} ({b.describe()})")

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
