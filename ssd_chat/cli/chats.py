"""``ssd-chat chats``: the saved chats (list, show, export, delete) and where their database is."""

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .options import fail

chats_app = typer.Typer(help="Saved chats: list, show, export, delete (resume one with `ssd-chat --resume ID`).",
                        no_args_is_help=True)
Db = Annotated[Optional[Path], typer.Option("--db", help="History database (default: the XDG data dir).", show_default=False)]


def _db_path(ctx: typer.Context, db: Path | None) -> Path:
    """The database the app uses: --db, then SSD_CHAT_DB or the config file's ``db``, then the default."""
    from ..chat import settings as config
    from ..history.store import default_db_path

    given = db or (ctx.obj or {}).get("db")
    try:
        values, _ = config.resolve({"db": str(given) if given else None})
    except config.ConfigError as e:
        raise fail(str(e)) from None
    return Path(values["db"] or default_db_path())


def _history(ctx: typer.Context, db: Path | None, read_only: bool = True):
    """The saved chats, or None when there is no database yet (reading never creates one).  Reading
    opens the file read-only: a read-only folder or a full disk does not stop it."""
    from ..history.store import History

    path = _db_path(ctx, db)
    if not path.is_file():
        return None
    h = History(path, read_only=read_only)
    if h.warning:
        raise _fail_safe(h.warning.split(";")[0])
    return h


def _fail_safe(message: str) -> typer.Exit:
    """An error line that may quote the database (a path, a stored text): escapes shown, not obeyed."""
    from ..chat.terminal import printable

    return fail(printable(message, one_line=True))


def _no_chat(chat_id: int, h) -> typer.Exit:
    where = "" if h is not None else " (there is no chat history database there yet)"
    return fail(f"no saved chat with id {chat_id}{where} (see `ssd-chat chats list`)")


@chats_app.command("list")
def chats_list(ctx: typer.Context, db: Db = None,
               json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List saved chats, newest first."""
    import time

    from ..chat.terminal import printable
    from ..history.store import HistoryError

    h = _history(ctx, db)
    try:
        convs = h.list_conversations() if h is not None else []
    except HistoryError as e:
        raise _fail_safe(str(e)) from None
    if json_out:
        typer.echo(json.dumps([{"id": c.id, "title": c.title, "messages": c.num_messages, "updated_at": c.updated_at}
                               for c in convs], indent=2))
        return
    if not convs:
        path = _db_path(ctx, db)
        typer.echo(f"no saved chats in {printable(str(path))}" + ("" if h is not None else " (it does not exist yet)"))
        return
    for c in convs:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated_at))
        typer.echo(f"{c.id:>5}  {when}  {c.num_messages:>3} message{'' if c.num_messages == 1 else 's'}  {printable(c.title, one_line=True)}")


@chats_app.command("path")
def chats_path(ctx: typer.Context, db: Db = None) -> None:
    """Print the history database's path."""
    typer.echo(str(_db_path(ctx, db)))


@chats_app.command("export")
def chats_export(
    ctx: typer.Context,
    chat_id: Annotated[int, typer.Argument(metavar="ID", help="The chat's id (see `chats list`).")],
    fmt: Annotated[Optional[str], typer.Option("--format", "-f", help="md (Markdown), jsonl (JSON Lines) or json; "
                                               "default: from the --output file's extension (.md, .jsonl, .json), else md.",
                                               show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.", show_default=False)] = None,
    db: Db = None,
    all_branches: Annotated[bool, typer.Option("--all-branches", help="Every branch (regenerated replies, edited "
                                               "messages), each message with its id and the one it follows; "
                                               "default: the current branch only.")] = False,
) -> None:
    """Export a chat with its per-reply metrics as Markdown, JSON Lines or JSON."""
    from ..chat.terminal import for_stream
    from ..history.store import HistoryError

    fmt = _export_format(fmt, output)
    h = _history(ctx, db)
    if h is None:
        raise _no_chat(chat_id, h)
    try:
        text = h.export(chat_id, fmt, all_branches)
    except KeyError:
        raise _no_chat(chat_id, h) from None
    except HistoryError as e:
        raise _fail_safe(str(e)) from None
    if output is None:
        sys.stdout.write(for_stream(text if text.endswith("\n") else text + "\n", sys.stdout))
    else:
        try:
            output.write_text(text, encoding="utf-8")
        except OSError as e:
            raise _fail_safe(f"cannot write {output}: {e.strerror or e}") from None
        typer.echo(for_stream(f"wrote {output}", sys.stderr), err=True)


def _export_format(fmt: str | None, output: Path | None) -> str:
    """``--format``, or the one ``--output``'s extension names (md without either); a format that
    contradicts the extension (``-f md -o x.json``) is refused rather than written under a misleading name."""
    from ..history.export import FORMATS, SUFFIXES

    if fmt is not None:
        fmt = "md" if fmt == "markdown" else fmt
        if fmt not in FORMATS:
            raise typer.BadParameter("use md, jsonl or json", param_hint="--format")
    named = SUFFIXES.get(output.suffix.lower()) if output is not None else None
    if fmt is not None and named is not None and fmt != named:
        raise _fail_safe(f"--format {fmt} writes {FORMATS[fmt]}, but {output} names {FORMATS[named]}: "
                         f"use -f {named} or a file ending in .{fmt}")
    return fmt or named or "md"


@chats_app.command("show")
def chats_show(ctx: typer.Context, chat_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None,
               all_branches: Annotated[bool, typer.Option("--all-branches", help="Every branch, not only the current one.")] = False) -> None:
    """Print a chat's current branch as Markdown (same as `chats export ID`)."""
    chats_export(ctx, chat_id, "md", None, db, all_branches)


@chats_app.command("delete")
def chats_delete(ctx: typer.Context, chat_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None) -> None:
    """Delete a saved chat."""
    h = _history(ctx, db, read_only=False)
    if h is None:
        raise _no_chat(chat_id, h)
    deleted = h.delete_conversation(chat_id)
    if h.warning:  # the file refused the write (the copy in memory does not count)
        raise _fail_safe(h.warning.split(";")[0])
    if not deleted:
        raise _no_chat(chat_id, h)
    typer.echo(f"deleted chat {chat_id}")
