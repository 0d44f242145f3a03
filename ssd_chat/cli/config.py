"""``ssd-chat config``: every setting, its value and where it came from; the config file's entries."""

import json
from dataclasses import replace
from typing import Annotated

import typer

from .options import console, fail

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
    from ..chat import settings as config

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
        out["mode"].update({"resolved": engine.get("mode"), "reason": engine.get("mode_reason"), "measured": engine.get("measured"),
                            "warnings": engine.get("warnings", []), "error": engine.get("mode_error")})
        out["dtype"]["precision"] = engine.get("precision")  # what the linears will compute in
        out["draft"]["label"] = engine.get("draft_label")  # the name the panel, ask --json, bench and serve give it
        typer.echo(json.dumps(out, indent=2))
        if invalid is not None:
            raise fail(str(invalid), 2 if invalid.usage else 1)
        return
    from rich.table import Table

    from ..chat.terminal import printable

    table = Table(title=f"ssd-chat settings (file: {config.config_file()})", title_justify="left")
    table.add_column("setting", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", overflow="fold")
    for key in config.DEFAULTS:
        v = values[key]
        shown = "—" if v is None else printable(str(v), one_line=True)  # a control character is shown, not obeyed
        if key == "mode" and v == "auto" and "mode" in engine:
            shown = f"auto → {engine['mode'] or 'AR until measured'}"
        elif key == "dtype" and engine.get("precision") not in (None, v):
            shown = f"{v} → {engine['precision']}"
        elif key == "draft" and engine.get("draft_label"):
            shown = engine["draft_label"] + (" (engine default)" if v is None else "")
        elif key in engine and v is None:
            shown = f"{engine[key]} (engine default)" if engine[key] is not None else "— (AR loads none)"
        elif v is None and key in ("temperature", "top_p", "top_k", "repetition_penalty"):  # engine/load/gen_defaults.py
            from ..engine import CHAT_DEFAULT

            shown = f"the model's generation_config, else {CHAT_DEFAULT[key]}"
        elif v is None and key in ("frequency_penalty", "presence_penalty"):
            shown = "0 (off)"
        if ("file", key) in problems:  # the file's unusable value, left out (the error says why)
            shown += f" (file: {problems['file', key][0]!r}, not used)"
        table.add_row(key, shown, config.describe_source(key, sources[key]))
    console().print(table)
    if invalid is not None:
        raise fail(str(invalid), 2 if invalid.usage else 1)
    if "mode_reason" in engine:
        console().print(f"mode: {engine['mode_reason']}", markup=False, highlight=False)
        if engine.get("measured"):
            console().print(engine["measured"]["words"], markup=False, highlight=False)
        for w in engine["warnings"]:
            console().print(f"warning: {w}", markup=False, highlight=False)
    else:
        console().print(f"these settings cannot start: {engine['mode_error']}", markup=False, highlight=False)


def engine_in_force(values: dict) -> dict:
    """What the engine will use for the settings left to it, and what mode ``auto`` resolves to here;
    ``{"mode_error": ...}`` when the settings cannot load (the same error a start would give)."""
    from ..chat.settings import engine_config
    from ..engine import probe_in_config as in_config, SSDChatError, parse_placement, planned_precision as planned
    from ..engine import preflight as check, in_force

    try:
        pre = check(engine_config(values))
    except (SSDChatError, ValueError) as e:
        return {"mode_error": str(e)}
    mode, why, rec = in_config(pre)  # auto with a draft: what the probe measured here (and when), else not yet
    out = dict(in_force(replace(pre.config, mode=mode or pre.config.mode)))
    out.update(mode=mode, mode_reason=why, warnings=list(pre.warnings))
    if rec is not None:
        out["measured"] = {"at": rec.at, "verdict": rec.verdict, "load": vars(rec.load),
                           "words": f"measured {rec.when()} ({rec.load.words()})"}
    c = pre.config
    out["precision"] = planned(c.target, c.target_device, c.dtype) or str(parse_placement(c.target_device, c.dtype).dtype).removeprefix("torch.")
    return out


@config_app.command("path")
def config_path() -> None:
    """Print the config file's path."""
    from ..chat.settings import config_file

    typer.echo(str(config_file()))


# a value such as -1 is a value, not an option: the range check gets it and says what is allowed
@config_app.command("set", context_settings={"ignore_unknown_options": True})
def config_set(key: str, value: str) -> None:
    """Write KEY = VALUE to the config file (checked first). Example: `ssd-chat config set mode ssd`."""
    from ..chat.settings import ConfigError, set_value
    from ..chat.terminal import printable

    try:
        path = set_value(key, value)
    except ConfigError as e:
        raise fail(str(e)) from None
    typer.echo(f"{key.replace('-', '_')} = {printable(value, one_line=True)}  ({path})")  # the value's escapes shown, not obeyed


@config_app.command("unset")
def config_unset(key: str) -> None:
    """Remove KEY from the config file (back to the default)."""
    from ..chat.settings import ConfigError, set_value

    try:
        path = set_value(key, None)
    except ConfigError as e:
        raise fail(str(e)) from None
    typer.echo(f"{key.replace('-', '_')} removed ({path})")


@config_app.command("measure")
def config_measure(ctx: typer.Context) -> None:
    """Measure AR, SD and SSD on this machine now (about 2 minutes) and keep the fastest for `auto`."""
    from ..chat import settings as config
    from ..chat.measure import measure_now
    from ..engine import SSDChatError

    given = {k_: v for k_, v in ((ctx.parent.obj if ctx.parent else None) or ctx.obj or {}).items() if k_ in config.DEFAULTS}
    values, _sources = config.resolve(given)
    try:
        mode, why, rec = measure_now(values)
    except SSDChatError as e:
        raise fail(e) from None
    lines = [f"auto → {mode}" + ("" if rec else " (nothing to measure)"), why]
    if rec is not None:
        lines.append(f"measured {rec.when()} ({rec.load.words()})")
    console().print("\n".join(lines), markup=False, highlight=False)
