"""``/model``: the models on this machine (as ``ssd-chat models list`` finds them), and switching the target
for the next chat: the name is checked before anything is unloaded, a dialog asks, then the old backend
closes (its engine process and speculator exit) and a new one loads with the load line, as at startup
(:class:`ModelSwitch`); the app builds and loads the backend."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from typing import Any

from ..chat.backend import readable
from ..chat.terminal import printable
from .replies import settle
from .widgets.confirm_dialog import ConfirmDialog

# drafts made from whichever target is loaded: they follow it to the new one (another model as draft does not)
FOLLOWS_TARGET = ("copy", "int8", "trained", "features")
_LAYERS = re.compile(r"^layers:\d+$")


def follows_target(draft: str | None) -> bool:
    return draft in FOLLOWS_TARGET or bool(draft and _LAYERS.match(draft))


def target_values(values: dict[str, Any], name: str, engine_changes: dict[str, Any]) -> dict[str, Any]:
    """The settings of the new backend: the target ``name``, the mode settings in force, a draft derived from the
    target kept, any other draft dropped to the new target's default."""
    out = {**values, **engine_changes, "target": name}
    if not follows_target(out.get("draft")):
        out["draft"] = None
    out.pop("resume", None)
    return out


def local_models() -> list[Any]:
    from ..engine import model_cache as store  # imports torch: called in a thread

    return store.local_models()


def in_use(models: list[Any], target: str | None) -> Any:
    """The local model the target ``target`` names, or None."""
    from pathlib import Path

    from ..engine import resolve_model

    try:
        spec = resolve_model(target or "")
    except Exception:  # noqa: BLE001 - a target no longer resolvable is simply not marked
        return None
    for m in models:
        if (spec.kind == "hub" and m.kind == "hub" and m.name == spec.source) or (
                spec.kind == "gguf" and m.kind != "hub" and Path(spec.source).resolve() == Path(m.path).resolve()):
            return m
    return None


def check_target(name: str) -> str:
    """A ModelError for a name that is no model, and offline the CLI's "not in the local cache ... hf download"
    message; else a note for the question ("" when the model is here)."""
    from ..engine import resolve_model, check_pair

    resolve_model(name)
    return "It is not on this machine yet: loading downloads it." if check_pair(name, None) else ""


def completions(models: list[Any]) -> list[str]:
    """What ``/model`` completes to: each local model's aliases, then its name (hub id or file)."""
    return list(dict.fromkeys(n for m in models for n in [*m.aliases, m.name]))


class ModelSwitch:
    """``ctl`` is the chat's controller."""

    def __init__(self, ctl: Any) -> None:
        self.ctl, self.view = ctl, ctl.view
        self.names: list[str] | None = None  # what Tab completes /model NAME to

    async def command(self, arg: str) -> None:
        """``/model`` lists the local models; ``/model NAME`` asks, then switches the target."""
        chat = self.view.chat
        if not arg:
            await self.list_models()
            return
        if self.view.app.backend_factory is None:
            await chat.add_notice("this app runs one backend (a replay or a demo): it cannot switch models", "warning")
            return
        if why := self.refused():
            await chat.add_notice(why, "warning")
            return
        try:  # before anything is unloaded: a bad or unreachable name changes nothing
            note = await asyncio.to_thread(check_target, arg)
        except Exception as e:  # noqa: BLE001 - one line, the chat goes on with the model it has
            await chat.add_notice(printable(f"cannot switch to {arg}: {readable(e)}", one_line=True), "error")
            return
        question = f"Switch the target to {arg}? The current chat stays saved; the next chat uses {arg}." + (f" {note}" if note else "")

        def done(yes: bool | None) -> None:
            if yes:
                self.view.run_worker(self.switch(arg), exclusive=False)

        self.view.app.push_screen(ConfirmDialog(question, "Switch"), done)

    def refused(self) -> str | None:
        c = self.ctl
        if c.streaming():
            return "a reply is streaming: stop it first (Esc), then /model NAME"
        if not c.ready and not c.load_error:
            return "the model is still loading; switch once it is ready"
        if c.switching is not None:
            return f"still switching to {c.switching}; switch the model after that"
        if c.recorder is not None:
            return "this session is being recorded (--record): a recording holds one model"
        return None

    async def switch(self, name: str) -> None:
        """Close the backend, start a new chat and load ``name`` with the load line (the app's loading path)."""
        c, app = self.ctl, self.view.app
        if why := self.refused():  # a reply started while the dialog was open
            await self.view.chat.add_notice(why, "warning")
            return
        values = target_values(app.values, name, c.engine_changes)
        await settle(c.replies.worker, 15)
        old = c.backend
        c.ready, c.load_error = False, None
        app.sub_title = "loading…"
        with contextlib.suppress(Exception):  # a backend that failed to close is gone with the app at the latest
            await asyncio.to_thread(old.close)  # the engine process and its speculator exit
        app.values, app.engine_settings = values, {k: values.get(k) for k in ("k", "fan_out")}
        c.engine_changes = {}
        c.backend = app.backend = app.backend_factory(values)
        self.names = None
        await c.new_chat()  # its session replies through the new backend
        await self.view.chat.add_notice(f"the target is now {name}: loading it")
        app.start_load()

    async def list_models(self) -> None:
        try:
            target = str(self.view.app.values.get("target") or self.ctl.backend.info().get("target") or "?")
            found = await asyncio.to_thread(local_models)
            mine = await asyncio.to_thread(in_use, found, target)
        except Exception as e:  # noqa: BLE001
            await self.view.chat.add_notice(f"cannot list the local models: {readable(e)}", "error")
            return
        from ..engine import model_cache as store

        self.names = completions(found)
        lines = [f"in use: {target}", "models on this machine (ssd-chat models list):"]
        for m in found:
            aliases = f" ({', '.join(m.aliases)})" if m.aliases else ""
            lines.append(f"  {m.name}{aliases} · {store.human(m.size)}" + ("  ← in use" if m is mine else ""))
        if not found:
            lines.append("  none (ssd-chat models pull NAME fetches one)")
        lines.append("/model NAME switches the target for the next chat (Tab completes NAME)")
        await self.view.chat.add_notice("\n".join(lines))

    async def complete(self, event: Any) -> None:
        """Tab after ``/model PREFIX``: the longest common prefix of the local names that match; the candidates as a toast."""
        v = self.view
        prefix = event.text[len("/model "):].lstrip()
        if self.names is None:
            try:
                self.names = completions(await asyncio.to_thread(local_models))
            except Exception as e:  # noqa: BLE001
                v.app.notify(f"cannot list the local models: {readable(e)}", severity="error")
                return
        matches = [n for n in self.names if n.lower().startswith(prefix.lower())]
        if not matches:
            v.app.notify(f"no local model starts with '{prefix}' (/model lists them)", severity="warning")
            return
        if v.prompt.text != event.text:  # typed on meanwhile
            return
        common = os.path.commonprefix(matches)
        v.prompt.set_text("/model " + (common if len(common) >= len(prefix) else prefix))
        if len(matches) > 1:
            v.app.notify("  ".join(matches), title="local models")
