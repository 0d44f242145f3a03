"""``ssd-chat compare``: one prompt answered greedily in AR, SD and SSD on the same models."""

import json
from dataclasses import replace
from typing import Annotated, Any, Optional

import typer

from .options import SAMPLING_OPTIONS, engine_options, fail, settings, utf8_text


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

    from ..chat import compare as cmp
    from ..engine import SSDChatError, messages_for

    given_n = given.get("max_new_tokens")
    repeats = repeats or cmp.DEFAULT_REPEATS
    prompt = utf8_text(prompt, "the prompt")
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    # loaded as SD: the draft loads, no speculator starts until the SSD run
    values = settings({**given, "mode": "sd", "temperature": 0.0, "top_p": 1.0, "top_k": 0})
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    from ..chat.loading import load_engine
    try:
        params = replace(values["sampling"], max_new_tokens=given_n or cmp.DEFAULT_MAX_NEW_TOKENS)
        engine = load_engine(values)
    except SSDChatError as e:
        raise fail(e) from None
    if not json_out:
        typer.echo(f"AR, SD and SSD in turn, {repeats} time{'' if repeats == 1 else 's'} over, greedy, up to {params.max_new_tokens} tokens "
                   f"(target {engine.target.name}, draft {engine.draft.name if engine.draft else '?'}, k={engine.config.k}):")
    stop = threading.Event()
    try:
        ids, extra = engine.prompt_ids(messages_for(prompt, values.get("system"), []))
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
