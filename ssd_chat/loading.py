"""Loading the models for a command: libraries kept quiet, progress and warnings on stderr.

The chat app loads through its own backend (progress in its load line); everything else that
loads models from the command line (``ask``, ``compare``, ``serve``, the headless demo) comes here.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import typer


def quiet_libraries(download_bars: bool = False) -> None:
    """No library progress bars or warnings over our output (a full-screen app or a command's lines);
    with ``download_bars`` (a terminal), hub downloads keep their progress bars on stderr."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if not download_bars:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # also turns off huggingface-hub's bars ...
    if download_bars:
        enable_progress_bars()  # ... which we want for downloads
    else:
        disable_progress_bars()


def load_engine(values: dict[str, Any], progress_to_stderr: bool = True) -> Any:
    """Load models for resolved settings ``values``; progress goes to stderr as one updating line on a
    terminal, warnings (a model too large for this machine) as lines before anything downloads."""
    from .config import engine_config
    from .engine import Engine

    show = progress_to_stderr and sys.stderr.isatty()
    quiet_libraries(download_bars=show)
    cfg = engine_config(values)

    def progress(stage: str, frac: float | None) -> None:
        if show:
            sys.stderr.write(f"\r\x1b[2K{stage}…" + (f" {frac:.0%}" if frac is not None else ""))
            sys.stderr.flush()

    def warn(message: str) -> None:
        typer.echo(("\r\x1b[2K" if show else "") + f"ssd-chat: warning: {message}", err=True)

    try:
        return Engine.load(cfg, progress=progress, warn=warn)
    finally:
        if show:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()
