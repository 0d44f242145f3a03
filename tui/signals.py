"""SIGTERM and SIGHUP in the chat app: quit as Ctrl+C does, so the terminal is restored.

Textual leaves the alternate screen and turns mouse tracking off only on a normal exit; killed by the
default handlers, the app left the shell unusable.  A SIGHUP whose terminal is really gone (the window
closed) cannot be answered that way: Textual's output thread dies on the first write to it and the app
then blocks on its next one, so the app stops the reply and the speculator and leaves at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def catch(app: Any) -> None:
    """Install the handlers on the app's loop (whose close at exit puts the default ones back)."""
    if app.is_headless:  # Pilot tests: the test runner's handlers stay
        return
    loop = asyncio.get_running_loop()
    for sig in SIGNALS:
        loop.add_signal_handler(sig, received, app, sig)


def received(app: Any, sig: int) -> None:
    if app.signalled is not None:  # a second one: leave now (Textual still restores the terminal)
        app.exit(128 + sig)
        return
    app.signalled = sig
    if sig == signal.SIGHUP and not terminal_alive():
        leave_now(app, sig)
    app.run_worker(app.action_quit(), exclusive=False)


def terminal_alive() -> bool:
    """False once the terminal has hung up (its tty then answers every request with EIO)."""
    try:
        termios.tcgetattr(sys.__stdin__.fileno())
    except (termios.error, OSError, ValueError, AttributeError):
        return False
    return True


def leave_now(app: Any, sig: int) -> None:
    """Stop the engine's work, release the models and the speculator, close the history; exit without
    writing to the dead terminal."""
    chat = app.controller
    for stop in (getattr(chat.current, "stop", None), chat.compare.stop):
        if stop is not None:
            stop.set()
    for close in (app.backend.close, getattr(chat.recorder, "close", None), app.history.close):
        with contextlib.suppress(Exception):  # nothing can be shown any more; exit regardless
            if close is not None:
                close()
    os._exit(128 + sig)
