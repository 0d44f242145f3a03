"""Model loading, shown in the app: the stage, a progress bar, and "37% · 12 s".  The fraction is the stage's own
(a download's bytes, a conversion's tensors); a stage that cannot know its fraction shows a moving bar and the
seconds it has taken so far, never a percentage it does not have."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Label, ProgressBar

from ...chat.terminal import printable


class LoadStatus(Vertical):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.frac: float | None = None
        self._stage_t0 = time.monotonic()
        self._stage = ""

    def compose(self) -> ComposeResult:
        yield Label("starting…", id="load-stage", markup=False)  # stages and errors quote names and paths
        with Horizontal(id="load-row"):
            yield ProgressBar(total=None, show_percentage=False, show_eta=False, id="load-bar")
            yield Label("", id="load-percent")

    def on_mount(self) -> None:
        self._timer = self.set_interval(1.0, self._render_percent)

    def set_stage(self, stage: str, frac: float | None) -> None:
        if stage != self._stage:
            self._stage, self._stage_t0 = stage, time.monotonic()
        self.frac = frac
        self.query_one("#load-stage", Label).update(printable(stage))
        bar = self.query_one("#load-bar", ProgressBar)
        if frac is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=round(100 * frac))
        self._render_percent()

    def _render_percent(self) -> None:
        if self.is_mounted and self.display:
            seconds = f"{time.monotonic() - self._stage_t0:.0f} s"
            self.query_one("#load-percent", Label).update(seconds if self.frac is None else f"{self.frac:.0%} · {seconds}")

    def restart(self) -> None:
        """Shown again for the next load (``/model``), failed or hidden before."""
        self._timer.stop()
        self.remove_class("-failed")
        self.display = True
        self.query_one("#load-row").display = True
        self.set_stage("starting…", None)
        self._timer = self.set_interval(1.0, self._render_percent)

    def fail(self, message: str) -> None:
        self._timer.stop()
        self.add_class("-failed")
        self.query_one("#load-stage", Label).update(printable(message))
        self.query_one("#load-row").display = False
