"""Switch mode, k, fan-out, sampling (temperature, top-p, top-k, seed) and reply length between turns
(models stay loaded).  The fields are :data:`ssd_chat.tui.changes.FIELDS`, one line each."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from ...config import SAMPLING_KEYS
from ...engine.speculate.fanout import DEFAULT_FAN_OUT
from ...engine.params import SamplingParams
from ...terminal import printable
from ..changes import FIELDS, check_engine, parse_settings


class SettingsDialog(ModalScreen[dict | None]):
    """Returns the changed settings, or None when cancelled.  A field counts as changed when its text
    was edited; a bad value is refused in words below the fields and the dialog stays open."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: dict[str, Any]) -> None:
        super().__init__()
        self.current = current
        self.shown = {key: self._text(key) for key in FIELDS}

    def _text(self, key: str) -> str:
        v = self.current.get(key)
        if v is None and key in SAMPLING_KEYS:
            v = getattr(SamplingParams(), key)  # what the next reply runs with
        if key == "fan_out" and v is None:
            v = DEFAULT_FAN_OUT  # what SSD runs with when none was chosen
        return "" if v is None else str(v)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Settings for the next reply (models stay loaded)", classes="dialog-title")
            with Grid(id="settings-grid"):
                yield Label("mode")
                yield Select(self._modes(), value=self.current.get("mode") or "ar", allow_blank=False, id="mode",
                             compact=True)
                for key, (label, _) in FIELDS.items():
                    yield Label(label)
                    yield Input(self.shown[key], id=key, compact=True)
            yield Label("", id="settings-error", markup=False)  # errors quote what was typed
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def _modes(self) -> list[tuple[str, str]]:
        modes = [(m.upper(), m) for m in ("ar", "sd", "ssd")]
        mode = self.current.get("mode")
        if mode and mode not in dict(modes).values():  # `auto` until the model has loaded and it resolves
            modes.insert(0, (f"{mode.upper()} (unchanged)", mode))
        return modes

    def action_cancel(self) -> None:
        self.dismiss(None)

    def _apply(self) -> None:
        mode = str(self.query_one("#mode", Select).value)
        raw = {key: text for key in FIELDS if (text := self.query_one(f"#{key}", Input).value) != self.shown[key]}
        if mode != self.current.get("mode"):  # kept as is, even a mode not switched to yet (AUTO while loading)
            raw["mode"] = mode
        try:
            values = parse_settings(raw)
            check_engine(values, self.current)
        except ValueError as e:
            self.query_one("#settings-error", Label).update(printable(str(e)))
            return
        self.dismiss({k: v for k, v in values.items() if v != self.current.get(k)})

    def on_input_submitted(self) -> None:
        self._apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self._apply() if event.button.id == "apply" else self.action_cancel()
