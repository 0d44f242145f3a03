"""Demo sessions: the scripted prompts in ``assets/demo/*.txt``, typed into the app by itself
(``ssd-chat demo``) or run without the app to make a recording (``ssd-chat demo --headless --record F``).

Replaying a recording is :class:`ssd_chat.backend.ReplayBackend` over :mod:`ssd_chat.recorder`.
"""

import sys

import typer

from .options import fail


def demo_prompts() -> list[str]:
    """The scripted session: ``assets/demo/*.txt`` in name order, one prompt (or /command) per file."""
    from importlib import resources

    folder = resources.files("ssd_chat.assets") / "demo"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return [f.read_text(encoding="utf-8").strip() for f in files if f.read_text(encoding="utf-8").strip()]


def run_headless(values: dict, prompts: list[str]) -> int:
    """The scripted session on the real engine without the app; ``values["record"]`` gets the event log."""
    import threading

    from .config import sampling_params
    from .engine.errors import SSDChatError
    from .engine.events import Done, Error, Notice, Round, Token
    from .loading import load_engine
    from .recorder import Recorder, RecordingError
    from .session import Session
    from .backend import EngineBackend
    from .stats import format_stats
    from .tui.changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings

    try:
        backend = EngineBackend(values)
        backend.engine = load_engine(values)
        params = sampling_params(values, backend.engine.sampling_defaults)
    except SSDChatError as e:
        raise fail(str(e)) from None
    rec = None
    try:
        if values.get("record"):
            rec = Recorder(values["record"], backend.info())
        session = Session(backend.engine, system=values.get("system"))
        seen: set[int] = set()
        for p in prompts:
            if p.startswith("/"):
                name, _, arg = p[1:].partition(" ")
                key = SLASH_KEYS.get(name)
                if key is None:
                    raise fail(f"unknown demo command {p!r}")
                change = parse_settings({key: arg.strip()})
                if key in ENGINE_CHANGES:
                    backend.reconfigure(**change)
                else:
                    from dataclasses import replace

                    params = replace(params, **change)
                typer.echo(f"[{p}]", err=True)
                continue
            typer.echo(f"\n> {p}")
            if rec is not None:
                rec.turn(p, values.get("system"), {**backend.info(), "temperature": params.temperature})
            streamed = ""
            for ev in session.stream(p, params, threading.Event()):
                if rec is not None:
                    rec.event(ev)
                if isinstance(ev, Token):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    streamed += ev.text
                elif isinstance(ev, Notice):
                    typer.echo(f"[{ev.message}]", err=True)
                elif isinstance(ev, Round):
                    seen.update(c for _, cands in (ev.predicted or ()) for c in cands)
                elif isinstance(ev, Done):
                    sys.stdout.write(ev.text[len(streamed):] + "\n")
                    typer.echo(format_stats(ev.stats), err=True)
                elif isinstance(ev, Error):
                    raise fail(ev.message)
        if rec is not None:
            rec.vocab({i: t for i in sorted(seen) if (t := backend.token_text(i)) is not None})
            rec.close()
            if rec.error:  # the session ran, but its recording is cut short
                raise fail(rec.stopped_reason)
            typer.echo(f"recorded to {values['record']}", err=True)
    except (SSDChatError, RecordingError, ValueError) as e:
        raise fail(str(e)) from None
    finally:
        if rec is not None:
            rec.close()
        backend.close()
    return 0
