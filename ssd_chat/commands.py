"""The app's own commands: ``demo``, ``config`` and ``chats`` (registered on the CLI by ``register``)."""


import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from .options import (Budget, Draft, DraftDevice, Dtype, Compile, Fallback, FanOut, K, MaxNew, Mode, SaguaroC, Seed, System, Target,
                      TargetDevice, Temperature, TopK, TopP, TrustRemote, RepetitionPenalty, FrequencyPenalty, PresencePenalty, console, merge, settings, utf8_text)
from .options import fail as _fail


def register(app: typer.Typer) -> None:
    """Add ``demo``, ``compare``, ``config`` and ``chats`` to the ``ssd-chat`` app."""
    from .demo import demo_prompts, run_headless

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
        repetition_penalty: RepetitionPenalty = None, frequency_penalty: FrequencyPenalty = None, presence_penalty: PresencePenalty = None,
        max_new_tokens: MaxNew = None, target_device: TargetDevice = None, draft_device: DraftDevice = None,
        dtype: Dtype = None, fan_out: FanOut = None, budget: Budget = None, saguaro_c: SaguaroC = None,
        fallback: Fallback = None, compile: Compile = None, trust_remote_code: TrustRemote = None, system: System = None,
    ) -> None:
        """A scripted multi-turn chat that types itself into the app (real engine, mode auto as everywhere),
        or with --replay, a recorded session played at recorded timing with no model loaded."""
        if not speed > 0:
            raise typer.BadParameter("must be > 0", param_hint="--speed")
        if type_delay < 0:
            raise typer.BadParameter("must be >= 0", param_hint="--type-delay")
        local = {k_: v for k_, v in locals().items() if k_ not in ("ctx", "replay", "speed", "type_delay", "headless")}
        merged = merge(ctx, local)
        from .tui_launch import launch

        if replay is not None:
            from .recorder import RecordingError, read
            from .backend import ReplayBackend

            try:
                recording = read(replay)
            except RecordingError as e:
                raise _fail(str(e)) from None
            if not recording.turns:
                raise _fail(f"{replay} has no turns to replay")
            values = {"db": merged.get("db"), "record": merged.get("record"), "resume": None}
            values.update({k_: v for k_, v in recording.info.items() if k_ in ("mode", "target", "draft")})
            raise typer.Exit(launch(values, backend=ReplayBackend(recording, speed), type_delay_s=type_delay / speed))
        from .config import ConfigError

        try:
            values = settings(merged)
        except ConfigError as e:
            raise _fail(str(e)) from None
        if headless:
            raise typer.Exit(run_headless(values, demo_prompts()))
        raise typer.Exit(launch(values, script=demo_prompts(), type_delay_s=type_delay))

    # -- compare -------------------------------------------------------------------------
    @app.command()
    def compare(
        ctx: typer.Context,
        prompt: Annotated[str, typer.Argument(help="The question to answer in each mode.", show_default=False)],
        json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with every run and the verdict.")] = False,
        repeats: Annotated[Optional[int], typer.Option("--repeats", min=1, max=20, help="Runs of each mode, interleaved (AR, SD, SSD, AR, ...): the speedups are their medians, with the spread [default: 3].", show_default=False)] = None,
        target: Target = None, draft: Draft = None, k: K = None, max_new_tokens: MaxNew = None,
        target_device: TargetDevice = None, draft_device: DraftDevice = None, dtype: Dtype = None,
        fan_out: FanOut = None, budget: Budget = None, fallback: Fallback = None, compile: Compile = None, trust_remote_code: TrustRemote = None,
        system: System = None,
    ) -> None:
        """Answer PROMPT greedily in AR, SD and SSD in turn, --repeats times over, on the same models: the tok/s
        of each run, each speedup's median, spread and physical bound, and whether every output is identical
        (exit 1 if they are not, or a run failed)."""
        import threading

        from . import compare as cmp
        from .engine import chat
        from .engine.errors import ParamError, SSDChatError

        local = {k_: v for k_, v in locals().items() if k_ not in ("ctx", "prompt", "json_out", "repeats")}
        merged = merge(ctx, local)
        given_n = merged.get("max_new_tokens")
        repeats = repeats or cmp.DEFAULT_REPEATS
        prompt = utf8_text(prompt, "the prompt")
        if not prompt.strip():
            raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
        # loaded as SD: the draft loads, no speculator starts until the SSD run
        values = settings({**merged, "mode": "sd", "temperature": 0.0, "top_p": 1.0, "top_k": 0})
        values["max_new_tokens"] = given_n or cmp.DEFAULT_MAX_NEW_TOKENS
        if values.get("system"):
            values["system"] = utf8_text(values["system"], "--system")
        from .config import sampling_params
        from .loading import load_engine

        try:
            params = sampling_params(values)
            engine = load_engine(values)
        except ParamError as e:
            raise _fail(str(e), 2) from None
        except SSDChatError as e:
            raise _fail(str(e)) from None
        if not json_out:
            typer.echo(f"AR, SD and SSD in turn, {repeats} time{'' if repeats == 1 else 's'} over, greedy, up to {params.max_new_tokens} tokens "
                       f"(target {engine.target.name}, draft {engine.draft.name if engine.draft else '?'}, k={engine.config.k}):")
        stop = threading.Event()
        try:
            ids, extra = engine.prompt_ids(chat.messages_for(prompt, values.get("system"), []))
            if extra:
                from dataclasses import replace

                params = replace(params, stop=tuple(params.stop) + tuple(extra))
            from dataclasses import replace as _with

            result = cmp.run(lambda m: engine.reconfigure(mode=m),
                             lambda n: engine.stream(ids, _with(params, max_new_tokens=n) if n else params, stop), "sd",
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
        problems: dict = {}  # unusable file or environment entries: shown, left out, then exit non-zero
        values, sources = config.resolve(given, problems=problems)
        try:
            config.check(values, sources)
            invalid = None
        except config.ConfigError as e:  # shown with the values, then exit non-zero
            invalid = e
        if invalid is not None or problems:
            lines = ([f"{invalid}{'; ' if config.fix_hint(invalid, sources) else ''}{config.fix_hint(invalid, sources)}"]
                     if invalid is not None else []) + config.problem_lines(problems)
            invalid = config.ConfigError("\nssd-chat: error: ".join(lines), invalid is not None and invalid.usage)
        engine = engine_in_force(values) if invalid is None else {"mode_error": str(invalid)}
        if json_out:
            out = {k_: {"value": values[k_], "source": sources[k_]} for k_ in config.DEFAULTS}
            for k_, v in engine.items():
                if k_ in out and out[k_]["value"] is None:  # left to the engine: what it will use
                    out[k_]["in_force"] = v
            out["mode"].update({"resolved": engine.get("mode"), "reason": engine.get("mode_reason"),
                                "warnings": engine.get("warnings", []), "error": engine.get("mode_error")})
            out["dtype"]["precision"] = engine.get("precision")  # what the linears will compute in
            out["draft"]["label"] = engine.get("draft_label")  # the name the panel, ask --json, bench and serve give it
            typer.echo(json.dumps(out, indent=2))
            if invalid is not None:
                raise _fail(str(invalid), 2 if invalid.usage else 1)
            return
        from rich.table import Table

        table = Table(title=f"ssd-chat settings (file: {config.config_file()})", title_justify="left")
        table.add_column("setting", no_wrap=True)
        table.add_column("value", overflow="fold")
        table.add_column("source", overflow="fold")
        for key in config.DEFAULTS:
            v = values[key]
            shown = "—" if v is None else str(v)
            if key == "mode" and v == "auto" and "mode" in engine:
                shown = f"auto → {engine['mode'] or 'measured at the first start'}"
            elif key == "dtype" and engine.get("precision") not in (None, v):
                shown = f"{v} → {engine['precision']}"
            elif key == "draft" and engine.get("draft_label"):
                shown = engine["draft_label"] + (" (engine default)" if v is None else "")
            elif key in engine and v is None:
                shown = f"{engine[key]} (engine default)" if engine[key] is not None else "— (AR loads none)"
            elif v is None and key in ("temperature", "top_p", "top_k", "repetition_penalty"):  # engine/gen_defaults.py
                from .engine.gen_defaults import CHAT_DEFAULT

                shown = f"the model's generation_config, else {CHAT_DEFAULT[key]}"
            elif v is None and key in ("frequency_penalty", "presence_penalty"):
                shown = "0 (off)"
            if ("file", key) in problems:  # the file's unusable value, left out (the error says why)
                shown += f" (file: {problems['file', key][0]!r}, not used)"
            table.add_row(key, shown, config.describe_source(key, sources[key]))
        console().print(table)
        if invalid is not None:
            raise _fail(str(invalid), 2 if invalid.usage else 1)
        if "mode_reason" in engine:
            console().print(f"mode: {engine['mode_reason']}", markup=False, highlight=False)
            for w in engine["warnings"]:
                console().print(f"warning: {w}", markup=False, highlight=False)
        else:
            console().print(f"these settings cannot start: {engine['mode_error']}", markup=False, highlight=False)

    def engine_in_force(values: dict) -> dict:
        """What the engine will use for the settings left to it, and what mode ``auto`` resolves to here;
        ``{"mode_error": ...}`` when the settings cannot load (the same error a start would give)."""
        from .config import engine_config
        from .engine.errors import SSDChatError
        from .engine.models import parse_placement
        from .engine.precision import planned
        from .engine.preflight import check, in_force
        from .engine.probe import in_config

        try:
            pre = check(engine_config(values))
        except (SSDChatError, ValueError) as e:
            return {"mode_error": str(e)}
        mode, why = in_config(pre)  # auto with a draft: what the probe measured here, else that the first start measures
        out = dict(in_force(replace(pre.config, mode=mode or pre.config.mode)))
        out.update(mode=mode, mode_reason=why, warnings=list(pre.warnings))
        c = pre.config
        out["precision"] = planned(c.target, c.target_device, c.dtype) or str(parse_placement(c.target_device, c.dtype).dtype).removeprefix("torch.")
        return out

    @config_app.command("path")
    def config_path() -> None:
        """Print the config file's path."""
        from .config import config_file

        typer.echo(str(config_file()))

    @config_app.command("set")
    def config_set(key: str, value: str) -> None:
        """Write KEY = VALUE to the config file (checked first). Example: `ssd-chat config set mode ssd`."""
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

    def _history(ctx: typer.Context, db: Path | None, read_only: bool = True):
        """The saved chats, or None when there is no database yet (reading never creates one).  Reading
        opens the file read-only: a read-only folder or a full disk does not stop it."""
        from .history import History

        path = _db_path(ctx, db)
        if not path.is_file():
            return None
        h = History(path, read_only=read_only)
        if h.warning:
            raise _fail_safe(h.warning.split(";")[0])
        return h

    def _fail_safe(message: str) -> typer.Exit:
        """An error line that may quote the database (a path, a stored text): escapes shown, not obeyed."""
        from .terminal import printable

        return _fail(printable(message, one_line=True))

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
            raise _fail_safe(str(e)) from None
        if output is None:
            sys.stdout.write(for_stream(text if text.endswith("\n") else text + "\n", sys.stdout))
        else:
            try:
                output.write_text(text, encoding="utf-8")
            except OSError as e:
                raise _fail_safe(f"cannot write {output}: {e.strerror or e}") from None
            typer.echo(for_stream(f"wrote {output}", sys.stderr), err=True)

    @chats_app.command("show")
    def chats_show(ctx: typer.Context, chat_id: Annotated[int, typer.Argument(metavar="ID")], db: Db = None) -> None:
        """Print a chat as Markdown (same as `chats export ID`)."""
        chats_export(ctx, chat_id, "md", None, db)

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

    app.add_typer(chats_app, name="chats")


__all__ = ["register"]

