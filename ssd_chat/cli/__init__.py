"""The ``ssd-chat`` command line: every command is registered here, at the end, and defined in the
module of this folder named as the user types it (``ask.py``, ``serve.py``, ...).

``ssd-chat`` with no subcommand opens the chat app (:mod:`.chat`).  The
engine and sampling options (:func:`ssd_chat.cli.options.engine_options`) are shared by every command
and stay stable: given before the subcommand (``ssd-chat --target X ask ...``) or after it.
"""

from __future__ import annotations

import shutil
import sys
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperGroup

from .. import __version__
from . import ask, bench, chats, compare, config, demo, draft, models, serve
from .options import engine_options, merge, settings, utf8_text


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
app = typer.Typer(name="ssd-chat", help="Local LLM chat with exact speculative speculative decoding (SSD / Saguaro).",
                  add_completion=False, no_args_is_help=False, pretty_exceptions_enable=False, cls=_Commands,
                  context_settings={"help_option_names": ["-h", "--help"], "max_content_width": WIDE},
                  rich_markup_mode="rich" if _wide else None)


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
        from .chat import launch

        raise typer.Exit(launch(settings(values)))


app.command()(ask.ask)
app.command("bench")(bench.bench_command)
app.add_typer(draft.draft_app, name="draft")
app.command()(demo.demo)
app.command()(compare.compare)
app.add_typer(config.config_app, name="config")
app.add_typer(chats.chats_app, name="chats")
app.add_typer(models.models_app, name="models")
app.command()(serve.serve)


def main() -> None:
    """Console-script entry point: usage errors exit 2, runtime failures 1, Ctrl-C 130."""
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        sys.exit(130)
