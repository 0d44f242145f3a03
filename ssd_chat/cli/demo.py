"""``ssd-chat demo``: a scripted chat typed into the app by itself, or a recorded one replayed."""

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..chat.demo import demo_prompts, run_headless
from .options import engine_options, fail, merge, settings


@engine_options()
def demo(
    replay: Annotated[Optional[str], typer.Option("--replay", help="Play this recorded session in the app (a JSONL file, or the name of a shipped recording: see --list); no model is loaded.", show_default=False)] = None,
    speed: Annotated[float, typer.Option("--speed", help="Replay speed: 2 = twice as fast as recorded.")] = 1.0,
    record: Annotated[Optional[Path], typer.Option("--record", help="Also write this session's events to a JSONL file.", show_default=False)] = None,
    type_delay: Annotated[float, typer.Option("--type-delay", help="Seconds per typed character of the scripted prompts.")] = 0.03,
    headless: Annotated[bool, typer.Option("--headless", help="Run the scripted session without the app (prints the replies; with --record, makes a replayable recording).")] = False,
    simulate: Annotated[Optional[str], typer.Option("--simulate", metavar="PROFILE", help="With --headless --record: pad every forward of the real models to PROFILE's modelled GPU latency (h100-70b-1b, ...). The recording says it is a simulation.", show_default=False)] = None,
    slow_motion: Annotated[float, typer.Option("--slow-motion", help="With --simulate: run the modelled hardware this many times slower (so that this machine's real forwards fit in the padded time) and record at full speed.")] = 1.0,
    list_: Annotated[bool, typer.Option("--list", help="List the shipped recordings (their names work with --replay).")] = False,
    *, given: dict[str, Any],
) -> None:
    """A scripted multi-turn chat that types itself into the app (real engine, mode auto as everywhere),
    or with --replay, a recorded session played at recorded timing with no model loaded."""
    if not speed > 0:
        raise typer.BadParameter("must be > 0", param_hint="--speed")
    if type_delay < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--type-delay")
    merged = merge(given, {"record": record})
    from ..chat.recordings import listing, resolve

    if list_:
        typer.echo(listing())
        raise typer.Exit(0)
    if simulate is not None:
        from ..engine import simulate as sim

        if replay is not None or not headless or record is None:
            raise fail("--simulate makes a recording: use it with --headless --record FILE", 2)
        try:
            sim.load_profile(simulate)
        except sim.ProfileError as e:
            raise fail(str(e), 2) from None
        if not slow_motion >= 1.0:
            raise typer.BadParameter("must be >= 1", param_hint="--slow-motion")
    from .chat import launch

    if replay is not None:
        from ..chat.backend import ReplayBackend
        from ..chat.recorder import RecordingError, read

        try:
            replay = resolve(replay)
            recording = read(replay)
        except (RecordingError, ValueError) as e:
            raise fail(str(e)) from None
        if not recording.turns:
            raise fail(f"{replay} has no turns to replay")
        values = {"db": merged.get("db"), "record": merged.get("record"), "resume": None, "replay": True}
        values.update({k_: v for k_, v in recording.info.items() if k_ in ("mode", "target", "draft")})
        raise typer.Exit(launch(values, backend=ReplayBackend(recording, speed), type_delay_s=type_delay / speed))
    values = settings(merged)  # a bad setting: one line and exit 2 or 1 (options.settings)
    if headless:
        raise typer.Exit(run_headless(values, demo_prompts(), simulate, slow_motion))
    raise typer.Exit(launch(values, script=demo_prompts(), type_delay_s=type_delay))
