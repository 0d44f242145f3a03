"""Open the chat app from resolved settings (``ssd-chat`` with no subcommand, and ``ssd-chat demo``).

Kept apart from ``cli.py`` so the CLI imports Textual and torch only when the app opens.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def open_history(values: dict[str, Any]):
    """The saved chats; a replay keeps its chat in memory: a recording is not something the user said."""
    from ..history.store import History, default_db_path

    if values.get("replay"):
        return History(None)
    return History(Path(values.get("db") or default_db_path()))


def build_backend(values: dict[str, Any]) -> Any:
    """The engine in a process of its own, unless asked not to (measuring the difference)."""
    from ..chat.backend import EngineBackend
    from ..chat.engine_process import ProcessBackend

    return EngineBackend(values) if os.environ.get("SSD_CHAT_IN_PROCESS") else ProcessBackend(values)


def launch(values: dict[str, Any], *, backend: Any = None, script: Iterable[str] = (), type_delay_s: float = 0.03) -> int:
    """Run the app until the user quits; returns the exit status: 0, or 1 when loading failed or the
    app crashed (Textual has then printed the traceback and set a non-zero ``return_code``).

    ``values`` are resolved settings (:func:`ssd_chat.chat.settings.resolve`) plus the pass-through
    options ``record`` (JSONL path), ``resume`` (chat id), ``db`` and ``baseline`` (a bench JSON report
    whose AR / SD tok/s make the panel's speedups *measured*).
    """
    from ..chat.loading import quiet_libraries
    from ..chat.recorder import Recorder, RecordingError
    from ..engine import SSDChatError, resolve_model

    if backend is None and values.get("target"):
        try:
            resolve_model(values["target"])  # a wrong name is refused before the app opens and torch imports
        except SSDChatError as e:
            sys.stderr.write(f"ssd-chat: error: {e}\n")
            return 1
    from ..engine import threads

    threads.coordinator()  # before anything computes here: this thread becomes the UI's
    quiet_libraries()
    recorder = None
    if values.get("record"):
        try:
            info = {k: values.get(k) for k in ("mode", "target", "draft", "k", "fan_out", "target_device", "draft_device")}
            recorder = Recorder(values["record"], info)
        except RecordingError as e:
            sys.stderr.write(f"ssd-chat: error: {e}\n")
            return 1
    baselines = []
    if values.get("baseline"):
        from ..tui.widgets.figures import baselines_from_bench

        try:
            baselines = baselines_from_bench(values["baseline"])
        except ValueError as e:
            sys.stderr.write(f"ssd-chat: error: {e}\n")
            return 1
    from ..engine import processes
    from ..tui.app import ChatApp

    processes.prepare()  # before Textual swaps out stderr: the speculator's spawn needs a real fd

    owned = backend is None
    if backend is None:
        backend = build_backend(values)
    app = ChatApp(backend, settings=values, history=open_history(values), recorder=recorder, resume=values.get("resume"),
                  script=script, type_delay_s=type_delay_s, baselines=baselines,
                  backend_factory=build_backend if owned else None)  # /model: a replay or a given backend stays as it is
    try:
        app.run()
    finally:
        if owned:
            for b in {id(backend): backend, id(app.backend): app.backend}.values():  # the first, and the one /model loaded
                b.close()  # already closed on quit; here for a crash of the app (idempotent)
        if recorder is not None:
            recorder.close()
    if app.history.warning:
        sys.stderr.write(f"ssd-chat: warning: {app.history.warning}\n")
    if app.signalled is not None:  # quit cleanly on SIGTERM / SIGHUP; the status still says which
        return 128 + app.signalled
    if app.chat_view.load_error:
        sys.stderr.write(f"ssd-chat: error: {app.chat_view.load_error}\n")
        return 1
    return 1 if app.return_code is None else app.return_code  # None: the app never got to exit normally
