"""Switch mode, k, fan-out, temperature and reply length between turns (models stay loaded)."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from ...terminal import printable
from ..changes import parse_settings

FIELDS = [("k", "k (draft tokens per round)"), ("fan_out", "fan-out (geometric, uniform:F, 3,2,1)"),
          ("temperature", "temperature (0 = greedy)"), ("max_new_tokens", "max new tokens")]


class SettingsDialog(ModalScreen[dict | None]):
    """Returns the changed settings, or None when cancelled."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: dict[str, Any]) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label("Settings for the next reply (models stay loaded)", classes="dialog-title")
            with Grid(id="settings-grid"):
                yield Label("mode")
                yield Select(self._modes(), value=self.current.get("mode") or "ar", allow_blank=False, id="mode")
                for key, label in FIELDS:
                    yield Label(label)
                    v = self.current.get(key)
                    yield Input("" if v is None else str(v), id=key)
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
        raw = {"mode": "" if mode == self.current.get("mode") else mode}  # kept as is, even a mode not switched to
        raw.update({key: self.query_one(f"#{key}", Input).value for key, _ in FIELDS})
        try:
            values = parse_settings(raw)
        except ValueError as e:
            self.query_one("#settings-error", Label).update(printable(str(e)))
            return
        self.dismiss({k: v for k, v in values.items() if v != self.current.get(k)})

    def on_input_submitted(self) -> None:
        self._apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self._apply() if event.button.id == "apply" else self.action_cancel()
