"""Loading the models for a command: libraries kept quiet, progress and warnings on stderr.

The chat app loads through its own backend (progress in its load line); everything else that
loads models from the command line (``ask``, ``compare``, ``serve``, the headless demo) comes here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import typer


class NotApplicable(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." (logged when torch.utils.cpp_extension is
    imported on a machine with a CUDA toolkit but no GPU): it reads like an error and is about nothing this
    program does; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def quiet_libraries() -> None:
    """No library progress bars or warnings over our output (a full-screen app or a command's lines);
    hub downloads report through :func:`tqdm_to` where a load line shows them."""
    cpp = logging.getLogger("torch.utils.cpp_extension")  # before torch imports it
    if not any(isinstance(f, NotApplicable) for f in cpp.filters):
        cpp.addFilter(NotApplicable())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    disable_progress_bars()


def tqdm_to(progress: Callable[[str, "float | None"], None]) -> Any:
    """A tqdm class whose bars report to ``progress`` (the app's load line, ``ask``'s stderr line) instead of
    drawing bars of their own (hub downloads)."""
    try:
        from tqdm.auto import tqdm as base
    except ImportError:  # pragma: no cover
        return None

    class AppTqdm(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = False
            kwargs["file"] = open(os.devnull, "w")  # noqa: SIM115 - closed in close()
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            out = super().update(n)
            if self.total:
                progress(f"downloading {self.desc or ''}".strip(), min(1.0, self.n / self.total))
            return out

        def close(self) -> None:
            f = self.fp
            super().close()
            with contextlib.suppress(Exception):
                f.close()

    return AppTqdm


class StageLine:
    """The app's load line on a terminal's stderr: the stage, its percentage when it knows one, and the
    seconds spent on it, redrawn every second so a stage without a fraction (or a slow one) is visibly alive.
    One line, cut to the terminal's width, so it never wraps into a scroll of copies."""

    def __init__(self, stream: Any = None) -> None:
        import threading

        self.stream = stream or sys.stderr
        self.stage, self.frac, self.t0 = "starting", None, time.monotonic()
        self.lock = threading.Lock()
        self._done = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="ssd-chat-load-line", daemon=True)
        self._ticker.start()
        self.draw()

    def text(self) -> str:
        from .terminal import columns, printable

        seconds = f"{time.monotonic() - self.t0:.0f} s"
        line = f"{printable(self.stage, one_line=True)}… " + (seconds if self.frac is None else f"{self.frac:.0%} · {seconds}")
        width = columns(self.stream) - 1
        return line if len(line) <= width else line[: max(1, width - 1)] + "…"

    def update(self, stage: str, frac: float | None) -> None:
        with self.lock:
            if stage != self.stage:
                self.stage, self.t0 = stage, time.monotonic()
            self.frac = frac
        self.draw()

    def draw(self) -> None:
        with self.lock:
            if not self._done.is_set():
                self.stream.write("\r\x1b[2K" + self.text())
                self.stream.flush()

    def say(self, line: str) -> None:
        """A line of its own (a warning) above the load line."""
        with self.lock:
            self.stream.write("\r\x1b[2K" + line + "\n")
            self.stream.flush()
        self.draw()

    def _tick(self) -> None:
        while not self._done.wait(1.0):
            self.draw()

    def close(self) -> None:
        with self.lock:
            self._done.set()
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


class StageLog:
    """The load line's stages for a log (stderr not a terminal): one line per new stage, no redraws."""

    def __init__(self, stream: Any = None) -> None:
        self.stream, self.stage = stream or sys.stderr, None

    def update(self, stage: str, frac: float | None) -> None:
        if stage != self.stage:
            self.stage = stage
            self.say(f"ssd-chat: {stage}…")

    def say(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


def load_engine(values: dict[str, Any], progress_to_stderr: bool = True, start_decoder: bool = False, measure: str = "no",
                log_stages: bool = False) -> Any:
    """Load models for resolved settings ``values``; on a terminal, progress goes to stderr as the app's
    load line (stage, percentage, seconds); warnings (a model too large for this machine) as lines before
    anything downloads.  When stderr is not a terminal, nothing but the warnings, or with ``log_stages``
    (``serve``'s log) a line per stage."""
    show = progress_to_stderr and sys.stderr.isatty()
    line = StageLine() if show else StageLog() if progress_to_stderr and log_stages else None  # before the slow imports
    try:
        from .settings import engine_config
        from ..engine import resolve_model
        from .terminal import wrapped

        cfg = engine_config(values)
        resolve_model(cfg.target)  # a wrong name is refused before torch and transformers import (seconds)
        quiet_libraries()
        from ..engine import Engine

        def progress(stage: str, frac: float | None) -> None:
            if line is not None:
                line.update(stage, frac)

        def warn(message: str) -> None:
            text = wrapped(f"ssd-chat: warning: {message}", sys.stderr)
            if line is not None:
                line.say(text)
            else:
                typer.echo(text, err=True)

        engine = Engine.load(cfg, progress=progress, tqdm_class=tqdm_to(progress) if show else None, warn=warn, measure=measure)
        if start_decoder:  # as the app does: SSD's speculator starts under the load line, not before the first token
            progress("starting the decoder", None)
            try:
                engine.decoder()
            except BaseException:
                engine.close()
                raise
        return engine
    finally:
        if line is not None:
            line.close()
