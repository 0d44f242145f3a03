"""Between-reply actions of the chat: new chat, copy, system prompt, settings (mode / k / fan-out /
temperature without reloading models), resuming and exporting saved chats, token colours and slash
commands.  Part of :class:`~ssd_chat.tui.chat_view.ChatView`, whose state they use; the app opens the
dialogs that lead here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..chat.backend import readable
from ..chat.settings import SAMPLING_KEYS
from ..engine import threads
from ..history.store import HistoryError, data_dir, metrics_line
from ..chat.changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings


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
    """Actions and commands; ``self`` is the ChatView."""

    async def action_new_chat(self) -> None:
        if self.current is not None and not self.current.finished:
            self.notify("stop the reply first (Esc)", severity="warning")
            return
        await self.chat.clear()
        self.session = self.new_session(self.system)
        self.conversation_id = None
        self.current = None
        self.panel.reset()
        self.panel.forget_replies()
        self.cache.clear()
        await self.chat.add_notice("new chat")

    def last_reply(self) -> str | None:
        return self.session.last("assistant")

    def action_copy_reply(self) -> None:
        text = self.last_reply()
        if text is None:
            self.notify("no reply to copy yet")
            return
        self.clipboard_text = text
        self.app.copy_to_clipboard(text)
        self.notify(f"copied the last reply ({len(text)} characters)")

    async def set_system(self, value: str) -> None:
        """A system prompt for the replies from here on: a message at this point of the chat, saved as one
        (the replies before it did not see it, and a resumed chat or an export shows it here)."""
        if (value or None) == self.system:
            self.notify("the system prompt is unchanged")
            return
        if self.conversation_id is None and all(m["role"] == "system" for m in self.messages):
            self.messages = [{"role": "system", "content": value}] if value else []  # nothing said yet: the start's
        else:
            self.session.set_system(value)
            self.history.set_system(self.conversation_id, value)
        await self.chat.add_notice(system_notice(value))

    async def apply_settings(self, changes: dict[str, Any]) -> bool:
        """Apply mode / k / fan-out (engine, no reload) and sampling settings from the next reply on.
        While the model loads they are remembered and applied once it is ready (:meth:`apply_pending`)."""
        if not self.ready:
            if self.load_error:
                await self.chat.add_notice("settings cannot change: the model did not load (Ctrl+C quits)", "warning")
                return False
            self.pending_settings.update(changes)
            desc = ", ".join(f"{k.replace('_', '-')} {v if v is not None else 'default'}" for k, v in changes.items())
            # a toast: the chat gets the lasting notice when the setting applies (apply_pending)
            self.notify(f"the model is still loading; {desc} will apply once it is ready")
            return True
        if self.current is not None and not self.current.finished:
            await self.chat.add_notice("settings change between replies: stop this one first (Esc)", "warning")
            return False
        engine_changes = {k: v for k, v in changes.items() if k in ENGINE_CHANGES}
        sampling = {k: v for k, v in changes.items() if k in SAMPLING_KEYS}
        if engine_changes:
            if self.switching is not None:
                await self.chat.add_notice(f"still switching to {self.switching}; change settings after that", "warning")
                return False
            self.switching = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in engine_changes.items())
            try:
                await threads.in_thread(threads.count(), self.backend.reconfigure, **engine_changes)  # may derive a draft (seconds)
            except Exception as e:  # noqa: BLE001 - shown, the old settings stay
                await self.chat.add_notice(f"cannot change {', '.join(engine_changes)}: {readable(e)}", "error")
                return False
            finally:
                self.switching = None
            self.engine_changes.update(engine_changes)
        self.params.update(sampling)
        self._update_info()
        desc = ", ".join(f"{k.replace('_', '-')} {v if v is not None else 'default'}" for k, v in changes.items())
        if changes.get("mode") == "auto":  # what auto chose here, and why (the panel's why line)
            info = self.backend.info()
            desc = desc.replace("mode auto", f"mode auto ({(info.get('mode') or '?').upper()} on this machine)", 1)
            if info.get("mode_reason"):
                desc += f" — {info['mode_reason']}"
        await self.chat.add_notice(f"from the next reply: {desc}")
        return True

    async def apply_pending(self) -> None:
        """The settings changed while the model loaded, now that it is ready."""
        changes, self.pending_settings = self.pending_settings, {}
        self.switching = None  # apply_settings takes it over before its first await
        await self.apply_settings(changes)

    async def resume(self, conversation_id: int) -> bool:
        """Show a saved chat and continue it."""
        if self.current is not None and not self.current.finished:
            await self.chat.add_notice("stop the reply first (Esc)", "warning")
            return False
        try:  # read it all before changing anything: a damaged chat leaves the current one as it was
            conv = self.history.get_conversation(conversation_id)
            saved = self.history.messages(conversation_id) if conv is not None else []
        except HistoryError as e:
            await self.chat.add_notice(f"cannot resume: {e}", "error")
            return False
        if conv is None:
            await self.chat.add_notice(f"no saved chat with id {conversation_id} (see `ssd-chat chats list`)", "error")
            return False
        await self.chat.clear()
        self.current = None
        self.panel.reset()
        self.panel.forget_replies()
        self.cache.clear()
        self.conversation_id, self.session = conv.id, self.new_session(None, [])
        await self.chat.add_notice(f"resumed chat {conv.id}: {conv.title}")
        await self.render_saved(saved)
        return True

    async def render_saved(self, saved: list[Any], anchor: bool = True) -> None:
        """Show saved messages (a chat's current branch) and continue the session from them."""
        for m in saved:
            if m.role == "system":  # where it was set: the replies above it did not see it
                await self.chat.add_notice(system_notice(m.content))
            elif m.role == "user":
                w = await self.chat.add_user(m.content)
            elif m.role == "assistant":
                status = "stopped" if m.status == "streaming" else m.status  # "streaming": the app died mid-reply
                meta = (metrics_line(m.metrics) if m.metrics else "") + ("" if status == "done" else f" · {status}")
                w = await self.chat.add_assistant(m.content, status, meta, self.colour)
                w.remove_class("-streaming")
            else:
                continue
            if m.role != "system":
                w.message_id = m.id
            self.messages.append({"role": m.role, "content": m.content})
        if anchor:
            self.chat.anchor()
        await self.show_branches()

    def export_chat(self, fmt: str = "md") -> Path | None:
        """Write this chat with its metrics to ``<data dir>/exports/chat-<id>.<md|jsonl>``; returns the path."""
        if self.conversation_id is None:
            self.notify("nothing to export yet", severity="warning")
            return None
        try:
            text = self.history.export(self.conversation_id, "jsonl" if fmt == "jsonl" else "md")
            out = data_dir() / "exports" / f"chat-{self.conversation_id}.{fmt}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except (KeyError, OSError, HistoryError) as e:
            self.notify(f"could not export: {e}", severity="error")
            return None
        self.notify(f"exported to {out}")
        return out

    def action_toggle_colour(self) -> None:
        self.colour = not self.colour
        self.chat.set_colour(self.colour)
        self.notify("token colours " + ("on: green = accepted draft tokens, orange = target (bonus) tokens" if self.colour else "off"))

    # -- slash commands ------------------------------------------------------------------
    async def command(self, line: str) -> None:
        name, _, arg = line[1:].partition(" ")
        name, arg = name.lower(), arg.strip()
        keys = SLASH_KEYS
        if name in keys:
            if not arg and keys[name] != "fan_out":
                await self.chat.add_notice(f"usage: /{name} VALUE", "warning")
                return
            try:
                changes = parse_settings({keys[name]: arg})
            except ValueError as e:
                await self.chat.add_notice(str(e), "error")
                return
            await self.apply_settings(changes)
        elif name == "system":
            await self.set_system(arg)
        elif name == "new":
            await self.action_new_chat()
        elif name == "copy":
            self.action_copy_reply()
        elif name == "chats":
            self.app.action_chats()
        elif name in ("colour", "color"):
            self.action_toggle_colour()
        elif name == "compare":
            if arg:
                self.prompt.set_text(arg)
            await self.action_compare()
        elif name == "help":
            await self.chat.add_notice(HELP)
        else:
            await self.chat.add_notice(f"unknown command '/{name}' — /help lists them", "warning")
