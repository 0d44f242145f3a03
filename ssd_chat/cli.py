"""The ``ssd-chat`` command line.

``ssd-chat`` with no subcommand opens the chat app; ``ssd-chat ask "..."`` answers once
on stdout; the other commands are defined in their own modules and registered at the end.  The
engine and sampling options (:func:`ssd_chat.options.engine_options`) are shared by every command
and stay stable: given before the subcommand (``ssd-chat --target X ask ...``) or after it.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperGroup

from . import __version__
from .bench.command import bench_command
from .chats_cmd import chats_app
from .commands import compare, demo
from .config import sampling_params
from .config_cmd import config_app
from .draft_cmd import draft_app
from .loading import load_engine
from .models_cmd import models_app
from .options import console, engine_options, fail, merge, settings, utf8_text
from .serve_cmd import serve
from .stats import SAMPLING_SHOWN, STATS_SHOWN, format_stats, ran_as


class _Commands(TyperGroup):
    """``ssd-chat "a question"`` is the commonest slip: say how to ask instead of only "No such command"."""

    def resolve_command(self, ctx: click.Context, args: list[str]):
        name = args[0] if args else ""
        if name and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib
            import shlex

            close = difflib.get_close_matches(name, self.list_commands(ctx), n=1, cutoff=0.75)
            hint = f"did you mean `ssd-chat {close[0]}`?" if close else f"to ask a question: ssd-chat ask {shlex.quote(name)}"
            ctx.fail(f"No such command {name!r}; {hint}")
        return super().resolve_command(ctx, args)


# Help and usage errors: Rich's boxed tables on a wide terminal; elsewhere (80 columns, a pipe) plain
# Click help, which wraps text instead of cutting option names and defaults short.
WIDE = 120
_wide = sys.stdout.isatty() and shutil.get_terminal_size().columns >= WIDE
app = typer.Typer(
    name="ssd-chat",
    help="Local LLM chat with exact speculative speculative decoding (SSD / Saguaro).",
    add_completion=False,
    no_args_is_help=False,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": WIDE},
    pretty_exceptions_enable=False,
    rich_markup_mode="rich" if _wide else None,
    cls=_Commands,
)


@app.callback(invoke_without_command=True)
@engine_options()
def main_callback(
    ctx: typer.Context,
    given: dict[str, Any],
    record: Annotated[Optional[str], typer.Option("--record", help="Write the app session's event stream to this JSONL file (replay: ssd-chat demo --replay FILE).", show_default=False)] = None,
    db: Annotated[Optional[str], typer.Option("--db", help="Chat history database (default: $XDG_DATA_HOME/ssd-chat/history.db).", show_default=False)] = None,
    resume: Annotated[Optional[int], typer.Option("--resume", help="Reopen saved chat ID in the app (see `ssd-chat chats list`).", show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="An `ssd-chat bench --json` report: the app's speedups vs AR/SD become measured against its tok/s.", show_default=False)] = None,
    version: Annotated[bool, typer.Option("--version", help="Print the version and exit.")] = False,
) -> None:
    """Open the chat app (no subcommand), or run one of the commands below."""
    if version:
        typer.echo(f"ssd-chat {__version__}")
        raise typer.Exit(0)
    values = merge(given, {"record": record, "db": db, "resume": resume, "baseline": baseline})
    ctx.obj = values  # what the subcommands' own options update (engine_options)
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    if ctx.invoked_subcommand is None:
        from .tui_launch import launch

        raise typer.Exit(launch(settings(values)))


@app.command()
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
    from . import attach as attaching

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
    from .server_client import ask_via_server

    served = ask_via_server(server, no_server, given, values, prompt, json_out, format_stats if stats else None)
    if served is not None:
        raise typer.Exit(served)
    from .engine.errors import ParamError, SSDChatError

    try:  # settings() has checked the sampling values: the model's defaults fill those left unset, below
        engine = load_engine(values, start_decoder=True)
    except ParamError as e:  # a setting out of range is bad usage
        raise fail(str(e), 2) from None
    except SSDChatError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    params = sampling_params(values, engine.sampling_defaults)  # the model's own where the user set none
    code = 0
    try:
        from .session import context_window

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
    from .engine.load.precision import of

    uses_draft = engine.draft is not None and engine.config.mode != "ar"
    return {"target": of(engine.target), "draft": of(engine.draft) if uses_draft else None}


def _answer(engine, prompt: str, values: dict[str, Any], params, json_out: bool, stats: bool) -> int:
    from .engine.events import Done, Error, Notice, Token
    from .session import Session

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
            from .server_client import length_note

            note = length_note(ev.reason, s.new_tokens, params.max_new_tokens)
            if note:
                typer.echo(note, err=True)
    return 0


app.command("bench")(bench_command)
app.add_typer(draft_app, name="draft")
app.command()(demo)
app.command()(compare)
app.add_typer(config_app, name="config")
app.add_typer(chats_app, name="chats")
app.add_typer(models_app, name="models")
app.command()(serve)


def main() -> None:
    """Console-script entry point: usage errors exit 2, runtime failures 1, Ctrl-C 130."""
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        sys.exit(130)
