"""Between-reply actions of the chat (:class:`ChatActions`): new chat, copy, system prompt, settings (mode /
k / fan-out / temperature without reloading models), resuming and exporting saved chats, token colours.
The controller calls them (slash commands are dispatched there); the app opens the dialogs that lead here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backend import readable
from ..config import SAMPLING_KEYS
from ..engine import threads
from ..history import HistoryError, data_dir, metrics_line
from .widgets.changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings


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

    async def new_chat(self) -> bool:
        """A new conversation (False: a reply streams, nothing changed)."""
        c, v = self.ctl, self.view
        if c.streaming():
            v.notify("stop the reply first (Esc)", severity="warning")
            return False
        await self._clear()
        c.session, c.conversation_id = c.new_session(c.system), None
        await v.chat.add_notice("new chat")
        return True

    async def _clear(self) -> None:
        """An empty transcript, panel and cache view, and no reply in progress (a new or a resumed chat)."""
        await self.view.chat.clear()
        self.ctl.current = None
        self.view.panel.reset()
        self.view.panel.forget_replies()
        self.view.cache.clear()

    def copy_reply(self) -> None:
        text = self.ctl.session.last("assistant")
        if text is None:
            self.view.notify("no reply to copy yet")
            return
        self.copy(text)
        self.view.notify(f"copied the last reply ({len(text)} characters)")

    def copy(self, text: str) -> None:
        self.clipboard_text = text
        self.view.app.copy_to_clipboard(text)

    async def set_system(self, value: str) -> None:
        """A system prompt for the replies from here on: a message at this point of the chat, saved as one
        (the replies before it did not see it, and a resumed chat or an export shows it here)."""
        c = self.ctl
        if (value or None) == c.system:
            self.view.notify("the system prompt is unchanged")
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
            self.view.notify(f"the model is still loading; {desc} will apply once it is ready")
            return True
        if c.streaming():
            await chat.add_notice("settings change between replies: stop this one first (Esc)", "warning")
            return False
        engine_changes = {k: v for k, v in changes.items() if k in ENGINE_CHANGES}
        sampling = {k: v for k, v in changes.items() if k in SAMPLING_KEYS}
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
        c.params.update(sampling)
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
        """``/mode ssd``, ``/k 4``, ``/temp 0.7`` ...: one setting typed as a command."""
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
        await self._clear()
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
                w = await chat.add_assistant(m.content, status, meta, c.colour)
                w.remove_class("-streaming")
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
            v.notify("nothing to export yet", severity="warning")
            return None
        try:
            text = self.ctl.history.export(cid, "jsonl" if fmt == "jsonl" else "md")
            out = data_dir() / "exports" / f"chat-{cid}.{fmt}"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text, encoding="utf-8")
        except (KeyError, OSError, HistoryError) as e:
            v.notify(f"could not export: {e}", severity="error")
            return None
        v.notify(f"exported to {out}")
        return out

    def toggle_colour(self) -> None:
        c = self.ctl
        c.colour = not c.colour
        self.view.chat.set_colour(c.colour)
        self.view.notify("token colours " + ("on: green = accepted draft tokens, orange = target (bonus) tokens" if c.colour else "off"))
