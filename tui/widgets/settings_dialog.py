"""Switch mode (``auto``: back to the mode auto chose here), k, fan-out, sampling (temperature, top-p,
top-k, seed) and reply length between turns (models stay loaded).  The fields are
:data:`ssd_chat.chat.changes.FIELDS`, one line each."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from ...chat.settings import SAMPLING_KEYS, EngineConfig
from ...engine import DEFAULT_FAN_OUT, SamplingParams
from ...chat.terminal import printable
from ...chat.changes import ENGINE_CHANGES, FIELDS, check_engine, parse_settings
from ...engine import CONFIG_MODES


class SettingsDialog(ModalScreen[dict | None]):
    """Returns the changed settings, or None when cancelled.  A field counts as changed when its text
    was edited; a bad value is refused in words below the fields and the dialog stays open."""

    BINDINGS = [Binding("escape", "dismiss", "Cancel")]

    def __init__(self, current: dict[str, Any]) -> None:
        super().__init__()
        self.current = current
        self.shown = {key: self._text(key) for key in FIELDS}
        self.mode = "auto" if current.get("auto") else (current.get("mode") or "ar")

    def _text(self, key: str) -> str:
        v = self.current.get(key)
        if v is None and key in ENGINE_CHANGES:  # k and fan-out as set, in AR too (they apply once SD / SSD run)
            v = (self.current.get("settings") or {}).get(key)
            if v is None:  # what SD / SSD run with when none was chosen
                v = {"k": EngineConfig().k, "fan_out": DEFAULT_FAN_OUT}.get(key)
        if v is None and key in SAMPLING_KEYS:
            v = getattr(SamplingParams(), key)  # what the next reply runs with
        return "" if v is None else str(v)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Settings for the next reply (models stay loaded)", classes="dialog-title")
            with Grid(id="settings-grid"):
                yield Label("mode")
                yield Select(self._modes(), value=self.mode, allow_blank=False, id="mode", compact=True)
                for key, (label, _) in FIELDS.items():
                    yield Label(label)
                    yield Input(self.shown[key], id=key, compact=True)
            yield Label("", id="settings-error", markup=False)  # errors quote what was typed
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _modes(self) -> list[tuple[str, str]]:
        resolved = self.current.get("mode") if self.current.get("auto") else None
        modes = [(f"AUTO ({resolved.upper()} here)" if m == "auto" and resolved else m.upper(), m) for m in CONFIG_MODES]  # auto: the mode auto chose for this machine (Engine.reconfigure)
        if self.mode not in CONFIG_MODES:  # a mode of a replay's recording
            modes.insert(0, (f"{self.mode.upper()} (unchanged)", self.mode))
        return modes

    def _apply(self) -> None:
        mode = str(self.query_one("#mode", Select).value)
        raw = {key: text for key in FIELDS if (text := self.query_one(f"#{key}", Input).value) != self.shown[key]}
        if mode != self.mode:  # AUTO while loading, or auto's choice, is kept as it is
            raw["mode"] = mode
        try:
            values = parse_settings(raw)
            check_engine(values, self.current)
        except ValueError as e:
            self.query_one("#settings-error", Label).update(printable(str(e)))
            return
        self.dismiss({k: v for k, v in values.items() if k == "mode" or v != self.current.get(k)})

    def on_input_submitted(self) -> None:
        self._apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self._apply() if event.button.id == "apply" else self.dismiss(None)
