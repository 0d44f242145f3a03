"""Model loading, shown in the app: stage text and a progress bar (indeterminate when unknown)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, ProgressBar

from ...terminal import printable


class LoadStatus(Vertical):
    def compose(self) -> ComposeResult:
        yield Label("starting…", id="load-stage", markup=False)  # stages and errors quote names and paths
        yield ProgressBar(total=None, show_eta=False, id="load-bar")

    def set_stage(self, stage: str, frac: float | None) -> None:
        self.query_one("#load-stage", Label).update(printable(stage))
        bar = self.query_one("#load-bar", ProgressBar)
        if frac is None:
            bar.update(total=None)
        else:
            bar.update(total=100, progress=round(100 * frac))

    def fail(self, message: str) -> None:
        self.add_class("-failed")
        self.query_one("#load-stage", Label).update(printable(message))
        self.query_one("#load-bar", ProgressBar).display = False
