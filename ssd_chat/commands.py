"""``ssd-chat demo`` (a scripted chat, or a recorded one replayed) and ``ssd-chat compare`` (one prompt in AR, SD and SSD)."""

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .demo import demo_prompts, run_headless
from .options import SAMPLING_OPTIONS, engine_options, fail, merge, settings, utf8_text


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
    from .recordings import listing, resolve

    if list_:
        typer.echo(listing())
        raise typer.Exit(0)
    if simulate is not None:
        from .engine.model import simulate as sim

        if replay is not None or not headless or record is None:
            raise fail("--simulate makes a recording: use it with --headless --record FILE", 2)
        try:
            sim.load(simulate)
        except sim.ProfileError as e:
            raise fail(str(e), 2) from None
        if not slow_motion >= 1.0:
            raise typer.BadParameter("must be >= 1", param_hint="--slow-motion")
    from .tui_launch import launch

    if replay is not None:
        from .recorder import RecordingError, read
        from .backend import ReplayBackend

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


@engine_options(exclude=("mode", *SAMPLING_OPTIONS, "saguaro_c"))  # greedy, in every mode
def compare(
    prompt: Annotated[str, typer.Argument(help="The question to answer in each mode.", show_default=False)],
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with every run and the verdict.")] = False,
    repeats: Annotated[Optional[int], typer.Option("--repeats", min=1, max=20, help="Runs of each mode, interleaved (AR, SD, SSD, AR, ...): the speedups are their medians, with the spread [default: 3].", show_default=False)] = None,
    *, given: dict[str, Any],
) -> None:
    """Answer PROMPT greedily in AR, SD and SSD in turn, --repeats times over, on the same models: the tok/s
    of each run, each speedup's median, spread and physical bound, and whether every output is identical
    (exit 1 if they are not, or a run failed)."""
    import threading

    from . import compare as cmp
    from .engine.load import chat
    from .engine.errors import ParamError, SSDChatError

    given_n = given.get("max_new_tokens")
    repeats = repeats or cmp.DEFAULT_REPEATS
    prompt = utf8_text(prompt, "the prompt")
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    # loaded as SD: the draft loads, no speculator starts until the SSD run
    values = settings({**given, "mode": "sd", "temperature": 0.0, "top_p": 1.0, "top_k": 0})
    values["max_new_tokens"] = given_n or cmp.DEFAULT_MAX_NEW_TOKENS
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    from .config import sampling_params
    from .loading import load_engine

    try:
        params = sampling_params(values)
        engine = load_engine(values)
    except ParamError as e:
        raise fail(str(e), 2) from None
    except SSDChatError as e:
        raise fail(str(e)) from None
    if not json_out:
        typer.echo(f"AR, SD and SSD in turn, {repeats} time{'' if repeats == 1 else 's'} over, greedy, up to {params.max_new_tokens} tokens "
                   f"(target {engine.target.name}, draft {engine.draft.name if engine.draft else '?'}, k={engine.config.k}):")
    stop = threading.Event()
    try:
        ids, extra = engine.prompt_ids(chat.messages_for(prompt, values.get("system"), []))
        if extra:
            params = replace(params, stop=tuple(params.stop) + tuple(extra))
        result = cmp.run(lambda m: engine.reconfigure(mode=m),
                         lambda n: engine.stream(ids, replace(params, max_new_tokens=n) if n else params, stop), "sd",
                         on_run=None if json_out else (lambda r: typer.echo(cmp.run_line(r))), stop=stop, repeats=repeats)
    except KeyboardInterrupt:
        stop.set()
        raise typer.Exit(130) from None
    finally:
        engine.close()
    if json_out:
        typer.echo(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        for r in result.runs:
            for n in r.notices:
                typer.echo(f"ssd-chat: {r.mode}: {n}", err=True)
        typer.echo(cmp.summary(result))
        if result.finished:
            first = result.finished[0]
            typer.echo(f"--- reply ({first.mode.upper()}{', the same in all' if result.identical else ''}) ---")
            typer.echo(first.done.text)
    failed = any(r.done is None for r in result.runs) or result.identical is False
    raise typer.Exit(1 if failed else 0)
