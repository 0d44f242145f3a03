"""``ssd-chat ask``: answer one question on stdout (through a running ``serve`` when there is one)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Annotated, Any, Optional

import typer

from ..chat.loading import load_engine
from ..chat.stats import SAMPLING_SHOWN, STATS_SHOWN, format_stats, ran_as
from .options import engine_options, fail, settings, utf8_text


@engine_options()
def ask(
    prompt: Annotated[Optional[str], typer.Argument(help="The question; '-' or nothing reads standard input.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with the text, token ids and stats at the end.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print a one-line summary (tok/s, TTFT, acceptance) to stderr.")] = False,
    server: Annotated[Optional[str], typer.Option("--server", help="Answer through this `ssd-chat serve` (e.g. http://127.0.0.1:8000) instead of loading the models.", show_default=False)] = None,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the models here even if a matching `ssd-chat serve` is running.")] = False,
    attach: Annotated[Optional[list[str]], typer.Option("--attach", "-a", metavar="FILE", help="Put this text file in the question, with its name, as a fenced block (repeatable).", show_default=False)] = None,
    *, given: dict[str, Any],
) -> None:
    """Answer one question on stdout (plain text; --json for machines); -a FILE puts a text file in it.

    Exit status: 0 on success, 2 on bad usage, 1 on a runtime failure, 130 on Ctrl-C.
    """
    values = settings(given)
    from ..chat import attach as attaching

    try:  # a missing, binary or huge file: one line, before anything loads
        files = [attaching.read(path) for path in attach or ()]
    except attaching.AttachError as e:
        raise fail(str(e)) from None
    if prompt is None and files and (sys.stdin is None or sys.stdin.isatty()):
        prompt = ""  # the files alone are the question
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise typer.BadParameter("give a PROMPT, or pipe one on standard input", param_hint="PROMPT")
        raw = getattr(sys.stdin, "buffer", None)  # bytes, so a bad byte gets our message, not a traceback
        prompt = utf8_text(raw.read() if raw is not None else sys.stdin.read(), "standard input")
    prompt = utf8_text(prompt, "the prompt")
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    if not prompt.strip() and not files:
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    try:  # the files' tokens against the target's context, with its tokenizer, before the weights load
        attaching.precheck(values, files)
    except attaching.AttachError as e:
        raise fail(str(e)) from None
    prompt = attaching.turn(files, prompt)
    # a running `ssd-chat serve` has the models loaded: ask it before even importing torch
    from ..server.client import ask_via_server

    served = ask_via_server(server, no_server, given, values, prompt, json_out, format_stats if stats else None)
    if served is not None:
        raise typer.Exit(served)
    from ..engine import SSDChatError

    try:  # settings() has checked the sampling values: the model's defaults fill those left unset, below
        engine = load_engine(values, start_decoder=True)
    except SSDChatError as e:  # a setting out of range (ParamError) is bad usage: fail() exits 2
        raise fail(e) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    params = values["sampling"].over(engine.sampling_defaults)  # the model's own where the user set none
    code = 0
    try:
        from ..chat.session import context_window

        attaching.check_fits([(f, attaching.count(engine.tokenizer, f.block())) for f in files], context_window(engine), engine.target.name)
        code = _answer(engine, prompt, values, params, json_out, stats)
    except (SSDChatError, attaching.AttachError) as e:  # raised while setting up the decoder, before any token
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        if not json_out:
            sys.stdout.write("\n")
        sys.stdout.flush()
        code = 130
    finally:
        engine.close()
    raise typer.Exit(code)


def precision_of(engine) -> dict[str, str | None]:
    from ..engine import precision_of as of

    uses_draft = engine.draft is not None and engine.config.mode != "ar"
    return {"target": of(engine.target), "draft": of(engine.draft) if uses_draft else None}


def _answer(engine, prompt: str, values: dict[str, Any], params, json_out: bool, stats: bool) -> int:
    from ..chat.session import Session
    from ..engine import Done, Error, Notice, Token

    session = Session(engine, system=values.get("system"))
    stop = threading.Event()
    streamed = ""
    for ev in session.stream(prompt, params, stop):
        if isinstance(ev, Token):
            if not json_out:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                streamed += ev.text
        elif isinstance(ev, Notice):
            typer.echo(f"ssd-chat: {ev.message}", err=True)
        elif isinstance(ev, Error):
            if not json_out:
                sys.stdout.write(ev.text[len(streamed):] + "\n")
            typer.echo(f"ssd-chat: error: {ev.message}", err=True)
            return 1
        elif isinstance(ev, Done):
            s = ev.stats
            if json_out:
                out = {
                    "text": ev.text,
                    "token_ids": list(ev.token_ids),
                    "mode": ran_as(s),  # the mode that produced the end of the reply
                    "mode_label": s.label,
                    "mode_reason": engine.mode_reason,
                    "target": engine.target.name,
                    "draft": engine.draft.name if engine.draft is not None and engine.config.mode != "ar" else None,
                    # what forwarded the models: core eager / core compiled / transformers
                    **{key: info[key] for key in ("forward", "draft_forward") for info in [engine.describe()]},
                    "precision": precision_of(engine),  # what the linears computed in: "gguf Q4_1", "float32"
                    "finish_reason": ev.reason,
                    "sampling": {key: getattr(params, key) for key in SAMPLING_SHOWN},
                    "stats": {key: getattr(s, key) for key in STATS_SHOWN},
                }
                sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(ev.text[len(streamed):] + "\n")
            sys.stdout.flush()
            if stats:
                typer.echo(format_stats(s), err=True)
            from ..server.client import length_note

            note = length_note(ev.reason, s.new_tokens, params.max_new_tokens)
            if note:
                typer.echo(note, err=True)
    return 0
