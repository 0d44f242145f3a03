"""Demo sessions: the scripted prompts in ``assets/demo/*.txt``, typed into the app by itself
(``ssd-chat demo``) or run without the app to make a recording (``ssd-chat demo --headless --record F``),
optionally on simulated hardware (``--simulate PROFILE``: the real models, every forward padded to the
profile's latency model, :mod:`ssd_chat.engine.model.simulate`; the recording says it is a simulation).

Replaying a recording is :class:`ssd_chat.chat.backend.ReplayBackend` over :mod:`ssd_chat.chat.recorder`.
"""

import sys

import typer

from .terminal import fail


def demo_prompts() -> list[str]:
    """The scripted session: ``assets/demo/*.txt`` in name order, one prompt (or /command) per file."""
    from importlib import resources

    folder = resources.files("ssd_chat.assets") / "demo"
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return [f.read_text(encoding="utf-8").strip() for f in files if f.read_text(encoding="utf-8").strip()]


def simulated_info(profile: str, scale: float = 1.0) -> dict:
    """What a simulated recording says of itself: the panel's device lines and its "simulated" row."""
    slow = f", {scale:g}x slow motion" if scale != 1.0 else ""
    where = f"cpu, padded to {profile} (simulated{slow})"
    return {"target_device": where, "draft_device": where, "simulated": profile, "time_scale": scale}


def padding_report(own: dict, children: dict) -> str:
    """One line per role: the forwards padded and those whose real compute overran the modelled time."""
    lines = []
    for where, tallies in (("verifier", own), ("speculator", children)):
        for role, t in sorted(tallies.items()):
            t = t if isinstance(t, dict) else t.as_dict()
            share = t["overruns"] / t["forwards"] if t["forwards"] else 0.0
            lines.append(f"{where} {role}: {t['forwards']} forwards padded to {t['modelled_s']:.2f} s modelled, "
                         f"{t['overruns']} overran it ({share:.0%}; real compute {t['compute_s']:.2f} s)")
    return "\n".join(lines)


def run_headless(values: dict, prompts: list[str], simulate: str | None = None, scale: float = 1.0) -> int:
    """The scripted session on the real engine without the app; ``values["record"]`` gets the event log.
    ``simulate``: a profile name; every forward is padded to it (here and in the speculator process),
    ``scale`` times slowed down, and the recording's times divided by ``scale`` (slow motion)."""
    import tempfile

    work = tempfile.TemporaryDirectory(prefix="ssd-chat-demo-sim-") if simulate else None
    try:
        return _run(values, prompts, simulate, work.name if work else None, scale)
    finally:
        if work is not None:
            from ..engine import simulate as sim

            sim.deactivate()
            work.cleanup()


def _run(values: dict, prompts: list[str], simulate: str | None, work: str | None, scale: float) -> int:
    import os
    import threading

    from ..engine import SSDChatError, Done, Error, Notice, Round, Token
    from .loading import load_engine
    from .recorder import Recorder, RecordingError, at_speed_event
    from .session import Session
    from .backend import EngineBackend
    from .stats import format_stats
    from .changes import ENGINE_CHANGES, SLASH_KEYS, parse_settings

    pad = None
    if simulate:  # before loading: the speculator process inherits the padding from the environment
        from ..engine import simulate as sim

        os.mkdir(os.path.join(work, "tallies"))
        pad = sim.activate(simulate, os.path.join(work, "device.lock"), os.path.join(work, "tallies"), scale)
    try:
        backend = EngineBackend(values)
        backend.engine = load_engine(values)
        params = values["sampling"].over(backend.engine.sampling_defaults)
    except SSDChatError as e:
        raise fail(str(e)) from None
    rec = None

    def info() -> dict:
        return {**backend.info(), **(simulated_info(simulate, scale) if simulate else {})}

    try:
        if values.get("record"):
            rec = Recorder(values["record"], info(), scale)
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
                rec.turn(p, values.get("system"), {**info(), "temperature": params.temperature})
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
                    typer.echo(format_stats(ev.stats if scale == 1.0 else at_speed_event(ev, scale).stats), err=True)
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
        backend.close()  # the speculator exits and writes its tallies
        if pad is not None:
            tag = f"SIMULATED {simulate}" + (f" ({scale:g}x slow motion)" if scale != 1.0 else "") + ": "
            typer.echo(tag + padding_report(pad.tallies, sim.child_tallies(os.path.join(work, "tallies"))).replace("\n", "\n" + tag), err=True)
    return 0
