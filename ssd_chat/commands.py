"""The app's own commands: ``demo``, ``config`` and ``chats`` (registered on the CLI by ``register``)."""


import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer


from .demo import fail as _fail


def register(app: typer.Typer) -> None:
    """Add ``demo``, ``config`` and ``chats`` to the ``ssd-chat`` app."""
    from . import cli
    from .demo import demo_prompts, run_headless
    from .cli import (Budget, Draft, DraftDevice, Dtype, Fallback, FanOut, K, MaxNew, Mode, SaguaroC, Seed, System,
                      Target, TargetDevice, Temperature, TopK, TopP, TrustRemote)

    @app.command()
    def demo(
        ctx: typer.Context,
        replay: Annotated[Optional[Path], typer.Option("--replay", help="Play this recorded session (JSONL) in the app; no model is loaded.", show_default=False)] = None,
        speed: Annotated[float, typer.Option("--speed", help="Replay speed: 2 = twice as fast as recorded.")] = 1.0,
        record: Annotated[Optional[Path], typer.Option("--record", help="Also write this session's events to a JSONL file.", show_default=False)] = None,
        type_delay: Annotated[float, typer.Option("--type-delay", help="Seconds per typed character of the scripted prompts.")] = 0.03,
        headless: Annotated[bool, typer.Option("--headless", help="Run the scripted session without the app (prints the replies; with --record, makes a replayable recording).")] = False,
        target: Target = None, draft: Draft = None, mode: Mode = None, k: K = None,
        temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, seed: Seed = None,
        max_new_tokens: MaxNew = None, target_device: TargetDevice = None, draft_device: DraftDevice = None,
        dtype: Dtype = None, fan_out: FanOut = None, budget: Budget = None, saguaro_c: SaguaroC = None,
        fallback: Fallback = None, trust_remote_code: TrustRemote = None, system: System = None,
    ) -> None:
        """A scripted multi-turn chat that types itself into the app (real engine, SSD by default),
        or with --replay, a recorded session played at recorded timing with no model loaded."""
        if not speed > 0:
            raise typer.BadParameter("must be > 0", param_hint="--speed")
        if type_delay < 0:
            raise typer.BadParameter("must be >= 0", param_hint="--type-delay")
        local = {k_: v for k_, v in locals().items() if k_ not in ("ctx", "replay", "speed", "type_delay", "headless")}
        merged = cli._merge(ctx, local)
        from .tui_launch import launch

        if replay is not None:
            from .recorder import RecordingError, read
            from .tui.backend import ReplayBackend

            try:
                recording = read(replay)
            except RecordingError as e:
                raise _fail(str(e)) from None
            if not recording.turns:
                raise _fail(f"{replay} has no turns to replay")
            values = {"db": merged.get("db"), "record": merged.get("record"), "resume": None}
            values.update({k_: v for k_, v in recording.info.items() if k_ in ("mode", "target", "draft")})
            raise typer.Exit(launch(values, backend=ReplayBackend(recording, speed), type_delay_s=type_delay / speed))
        merged.setdefault("mode", "ssd")
        from .config import ConfigError

        try:
            values = cli.settings(merged)
        except ConfigError as e:
            raise _fail(str(e)) from None
        if headless:
            raise typer.Exit(run_headless(values, demo_prompts()))
        raise typer.Exit(launch(values, script=demo_prompts(), type_delay_s=type_delay))

    # -- config --------------------------------------------------------------------------
    config_app = typer.Typer(help="Show or change settings (CLI > environment > config file > defaults).",
                             invoke_without_command=True, no_args_is_help=False)

    @config_app.callback()
    def config_show(
        ctx: typer.Context,
        json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    ) -> None:
        """Print every setting, its resolved value and where it came from."""
        if ctx.invoked_subcommand is not None:
            return
        from . import config

        given = {k_: v for k_, v in (ctx.obj or {}).items() if k_ in config.DEFAULTS}
        try:
            values, sources = config.resolve(given)
        except config.ConfigError as e:
            raise _fail(str(e)) from None
        try:
            config.check(values, sources)
            invalid = None
        except config.ConfigError as e:  # shown with the values, then exit non-zero
            invalid = e
        if json_out:
            typer.echo(json.dumps({k_: {"value": values[k_], "source": sources[k_]} for k_ in config.DEFAULTS}, indent=2))
            if invalid is not None:
                raise _fail(str(invalid), 2 if invalid.usage else 1)
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"ssd-chat settings (file: {config.config_file()})", title_justify="left")
        table.add_column("setting")
        table.add_column("value")
        table.add_column("source")
        for key in config.DEFAULTS:
            v = values[key]
            table.add_row(key, "—" if v is None else str(v), config.describe_source(key, sources[key]))
        Console().print(table)
        if invalid is not None:
            raise _fail(str(invalid), 2 if invalid.usage else 1)

    @config_app.command("path")
    def config_path() -> None:
        """Print the config file's path."""
        from .config import config_file

        typer.echo(str(config_file()))

    @config_app.command("set")
    def config_set(key: str, value: str) -> None:
        """Write KEY = VALUE to the config file (e.g. `ssd-chat config set mode ssd`)."""
        from .config import ConfigError, set_value

        try:
            path = set_value(key, value)
        except ConfigError as e:
            raise _fail(str(e)) from None
        typer.echo(f"{key.replace('-', '_')} = {value}  ({path})")

    @config_app.command("unset")
    def config_unset(key: str) -> None:
        """Remove KEY from the config file (back to the default)."""
        from .config import ConfigError, set_value

        try:
            path = set_value(key, None)
        except ConfigError as e:
            raise _fail(str(e)) from None
        typer.echo(f"{key.replace('-', '_')} removed ({path})")

    app.add_typer(config_app, name="config")

    # -- chats ---------------------------------------------------------------------------
    chats_app = typer.Typer(help="Saved chats: list, show, export, delete (resume one with `ssd-chat --resume ID`).",
                            no_args_is_help=True)
    Db = Annotated[Optional[Path], typer.Option("--db", help="History database (default: the XDG data dir).", show_default=False)]

    def _db_path(ctx: typer.Context, db: Path | None) -> Path:
        """The database the app uses: --db, then SSD_CHAT_DB or the config file's ``db``, then the default."""
        from . import config
        from .history import default_db_path

        given = db or (ctx.obj or {}).get("db")
        try:
            values, _ = config.resolve({"db": str(given) if given else None})
        except config.ConfigError as e:
            raise _fail(str(e)) from None
        return Path(values["db"] or default_db_path())

    def _history(ctx: typer.Context, db: Path | None):
        """The saved chats, or None when there is no database yet (reading never creates one)."""
        from .history import History

        path = _db_path(ctx, db)
        if not path.is_file():
            return None
        h = History(path)
        if h.warning:
            raise _fail(h.warning.split(";")[0])
        return h

    def _no_chat(chat_id: int, h) -> typer.Exit:
        where = "" if h is not None else " (there is no chat history database there yet)"
        return _fail(f"no saved chat with id {chat_id}{where} (see `ssd-chat chats list`)")

    @chats_app.command("list")
    def chats_list(ctx: typer.Context, db: Db = None,
                   json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
        """List saved chats, newest first."""
        import time

        from .history import HistoryError
        from .terminal import printable

        h = _history(ctx, db)
        try:
            convs = h.list_conversations() if h is not None else []
        except HistoryError as e:
            raise _fail(str(e)) from None
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
            typer.echo(f"{c.id:>5}  {when}  {c.num_messages:>3} messages  {printable(c.title, one_line=True)}")

    @chats_app.command("path")
    def chats_path(ctx: typer.Context, db: Db = None) -> None:
        """Print the history database's path."""
        typer.echo(str(_db_path(ctx, db)))

    @chats_app.command("export")
    def chats_export(
        ctx: typer.Context,
        chat_id: Annotated[int, typer.Argument(metavar="ID", help="The chat's id (see `chats list`).")],
        fmt: Annotated[str, typer.Option("--format", "-f", help="md (Markdown) or jsonl.")] = "md",
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write to this file instead of stdout.", show_default=False)] = None,
        db: Db = None,
    ) -> None:
        """Export a chat with its per-reply metrics as Markdown or JSONL."""
        from .history import HistoryError
        from .terminal import for_stream

        if fmt not in ("md", "markdown", "jsonl"):
            raise typer.BadParameter("use md or jsonl", param_hint="--format")
        h = _history(ctx, db)
        if h is None:
            raise _no_chat(chat_id, h)
        try:
            text = h.export_jsonl(chat_id) if fmt == "jsonl" else h.export_markdown(chat_id)
        except KeyError:
            raise _no_chat(chat_id, h) from None
        except HistoryError as e:
            raise _fail(str(e)) from None
        if output is None:
            sys.stdout.write(for_stream(text if text.endswith("\n") else text + "\n", sys.stdout))
        else:
            try:
                output.write_text(text, encoding="utf-8")
            except OSError as e:
                raise _fail(f"cannot write {output}: {e.strerror or e}") from None
            typer.echo(f"wrote {output}", err=True)

    @chats_app.command("show")
    def chats_show(ctx: typer.Context, chat_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None) -> None:
        """Print a chat as Markdown (same as `chats export ID`)."""
        chats_export(ctx, chat_id, "md", None, db)

    @chats_app.command("delete")
    def chats_delete(ctx: typer.Context, chat_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None) -> None:
        """Delete a saved chat."""
        h = _history(ctx, db)
        if h is None:
            raise _no_chat(chat_id, h)
        deleted = h.delete_conversation(chat_id)
        if h.warning:  # the file refused the write (the copy in memory does not count)
            raise _fail(h.warning.split(";")[0])
        if not deleted:
            raise _no_chat(chat_id, h)
        typer.echo(f"deleted chat {chat_id}")

    app.add_typer(chats_app, name="chats")


__all__ = ["register"]

