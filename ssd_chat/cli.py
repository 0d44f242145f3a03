"""The ``ssd-chat`` command line.

``ssd-chat`` with no subcommand opens the chat app; ``ssd-chat ask "..."`` answers once
on stdout.  The engine options below are shared by every command and stay stable:
given before the subcommand (``ssd-chat --target X ask ...``) or after it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
from typing import Annotated, Any, Optional

import click
import typer
from typer.core import TyperGroup

from . import __version__


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

def _choice(value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}")
    return value


# --- shared engine options (CLI > environment > config file > default) ----------------------
Target = Annotated[Optional[str], typer.Option("--target", "-t", help="Target model: alias, hub id org/name, local folder or .gguf file. Default: smollm2-135m-gguf (packaged).", show_default=False)]
Draft = Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (same tokenizer as the target), or a draft derived from the target: copy, int8, layers:N, trained / features (the drafts shipped for the packaged model), or a trained draft folder. Default: trained for the packaged model, int8 for others.", show_default=False)]
Mode = Annotated[Optional[str], typer.Option("--mode", "-m", callback=lambda v: _choice(v, ("auto", "ar", "sd", "ssd")), help="Decoding: auto (default: SSD where the machine has room for its speculator and there is a draft for the target, else AR; `ssd-chat config` says which and why), ar (autoregressive), sd (speculative), ssd (speculative speculative, Saguaro).", show_default=False)]
K = Annotated[Optional[int], typer.Option("--k", "-k", min=1, max=32, help="Draft tokens per round (SD/SSD).", show_default=False)]
Temperature = Annotated[Optional[float], typer.Option("--temperature", min=0.0, help="0 = greedy (exact token-for-token reproducibility).", show_default=False)]
TopP = Annotated[Optional[float], typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass (1 = off).", show_default=False)]
TopK = Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0 = off).", show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.", show_default=False)]
MaxNew = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens in one reply.", show_default=False)]
TargetDevice = Annotated[Optional[str], typer.Option("--target-device", help="auto, cpu, cpu:N, cuda, cuda:N, cuda:0,cuda:1 (sharded), mps.", show_default=False)]
DraftDevice = Annotated[Optional[str], typer.Option("--draft-device", help="Device for the draft / SSD speculator (same forms as --target-device).", show_default=False)]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.", show_default=False)]
FanOut = Annotated[Optional[str], typer.Option("--fan-out", help="SSD fan-out: geometric, uniform:F, or a list like 3,3,2,2,1.", show_default=False)]
Budget = Annotated[Optional[int], typer.Option("--budget", min=1, help="SSD cache budget B: outcomes pre-speculated per round.", show_default=False)]
SaguaroC = Annotated[Optional[float], typer.Option("--saguaro-c", min=0.0, max=1.0, help="Saguaro down-weighting C of the draft's top tokens at temperature > 0 (1 = off).", show_default=False)]
Fallback = Annotated[Optional[str], typer.Option("--fallback", callback=lambda v: _choice(v, ("neural", "fast", "auto")), help="SSD fallback on a cache miss: neural, fast or auto.", show_default=False)]
TrustRemote = Annotated[Optional[bool], typer.Option("--trust-remote-code/--no-trust-remote-code", help="Allow model repositories to run their own Python code (off by default).", show_default=False)]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.", show_default=False)]

ENGINE_KEYS = ("target", "draft", "mode", "k", "target_device", "draft_device", "dtype", "fan_out", "budget", "saguaro_c", "fallback", "trust_remote_code")
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed", "max_new_tokens")


def _merge(ctx: typer.Context, local: dict[str, Any]) -> dict[str, Any]:
    """Options given after the subcommand win over those given before it."""
    merged = dict(ctx.obj or {}) if ctx.obj else {}
    merged.update({k: v for k, v in local.items() if v is not None})
    return merged


def settings(values: dict[str, Any]) -> dict[str, Any]:
    """Fill unset options from the environment/config file and the defaults."""
    from . import config

    try:
        resolved, sources = config.resolve(values)
        config.check(resolved, sources)
    except config.ConfigError as e:  # one line naming the flag, SSD_CHAT_* variable or config.toml entry
        raise fail(str(e), 2 if e.usage else 1) from None
    return resolved


def engine_config(values: dict[str, Any]):
    from .engine import EngineConfig

    return EngineConfig(**{k: values[k] for k in ENGINE_KEYS if values.get(k) is not None})


def sampling_params(values: dict[str, Any]):
    from .engine import SamplingParams

    return SamplingParams(**{k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None})


def console():
    """A Rich console for tables: on a terminal its width; in a pipe or a file wide enough that names and
    paths are never cut short (Rich would assume 80 columns)."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=1000)


def fail(message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"ssd-chat: error: {message}", err=True)
    return typer.Exit(code)


def utf8_text(value: str | bytes, what: str) -> str:
    """``value`` as text, or a usage error (exit 2) naming the first byte that is not UTF-8.

    Text is never repaired: a replacement character would change what the model is asked
    without the user seeing it.  Arguments arrive with undecodable bytes as lone surrogates
    (Python's surrogateescape); standard input arrives as bytes.
    """
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        hint = ("it starts with a UTF-16 byte-order mark: convert it with `iconv -f utf-16 -t utf-8`"
                if raw[:2] in (b"\xff\xfe", b"\xfe\xff") else "convert it first, e.g. with `iconv -f latin1 -t utf-8`")
        raise typer.BadParameter(f"{what} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                                 f"ssd-chat reads UTF-8 text: {hint}") from None
    return text.removeprefix("\ufeff")  # a UTF-8 byte-order mark is not part of the question


def quiet_libraries(download_bars: bool = False) -> None:
    """No library progress bars or warnings over our output; hub downloads keep their
    progress bars on stderr when ``download_bars`` (a terminal)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import warnings

    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # also turns off huggingface-hub's bars ...
    if download_bars:
        from huggingface_hub.utils import enable_progress_bars

        enable_progress_bars()  # ... which we want for downloads


def load_engine(values: dict[str, Any], progress_to_stderr: bool = True):
    """Load models for ``values``; progress goes to stderr as one updating line on a terminal,
    warnings (a model too large for this machine) as lines before anything downloads."""
    from .engine import Engine

    show = progress_to_stderr and sys.stderr.isatty()
    quiet_libraries(download_bars=show)
    cfg = engine_config(values)

    def progress(stage: str, frac: float | None) -> None:
        if show:
            sys.stderr.write(f"\r\x1b[2K{stage}…" + (f" {frac:.0%}" if frac is not None else ""))
            sys.stderr.flush()

    def warn(message: str) -> None:
        typer.echo(("\r\x1b[2K" if show else "") + f"ssd-chat: warning: {message}", err=True)

    try:
        return Engine.load(cfg, progress=progress, warn=warn)
    finally:
        if show:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


@app.callback(invoke_without_command=True)
def main_callback(
    ctx: typer.Context,
    target: Target = None, draft: Draft = None, mode: Mode = None, k: K = None,
    temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, seed: Seed = None,
    max_new_tokens: MaxNew = None, target_device: TargetDevice = None, draft_device: DraftDevice = None,
    dtype: Dtype = None, fan_out: FanOut = None, budget: Budget = None, saguaro_c: SaguaroC = None,
    fallback: Fallback = None, trust_remote_code: TrustRemote = None, system: System = None,
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
    values = {k_: v for k_, v in locals().items() if k_ not in ("ctx", "version") and v is not None}
    ctx.obj = values
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    if ctx.invoked_subcommand is None:
        from .tui_launch import launch

        raise typer.Exit(launch(settings(values)))


@app.command()
def ask(
    ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(help="The question; '-' or nothing reads standard input.", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object with the text, token ids and stats at the end.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print a one-line summary (tok/s, TTFT, acceptance) to stderr.")] = False,
    server: Annotated[Optional[str], typer.Option("--server", help="Answer through this `ssd-chat serve` (e.g. http://127.0.0.1:8000) instead of loading the models.", show_default=False)] = None,
    no_server: Annotated[bool, typer.Option("--no-server", help="Load the models here even if a matching `ssd-chat serve` is running.")] = False,
    target: Target = None, draft: Draft = None, mode: Mode = None, k: K = None,
    temperature: Temperature = None, top_p: TopP = None, top_k: TopK = None, seed: Seed = None,
    max_new_tokens: MaxNew = None, target_device: TargetDevice = None, draft_device: DraftDevice = None,
    dtype: Dtype = None, fan_out: FanOut = None, budget: Budget = None, saguaro_c: SaguaroC = None,
    fallback: Fallback = None, trust_remote_code: TrustRemote = None, system: System = None,
) -> None:
    """Answer one question on stdout (plain text; --json for machines).

    Exit status: 0 on success, 2 on bad usage, 1 on a runtime failure, 130 on Ctrl-C.
    """
    local = {k_: v for k_, v in locals().items() if k_ not in ("ctx", "prompt", "json_out", "stats", "server", "no_server")}
    values = settings(_merge(ctx, local))
    if prompt is None or prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise typer.BadParameter("give a PROMPT, or pipe one on standard input", param_hint="PROMPT")
        raw = getattr(sys.stdin, "buffer", None)  # bytes, so a bad byte gets our message, not a traceback
        prompt = utf8_text(raw.read() if raw is not None else sys.stdin.read(), "standard input")
    prompt = utf8_text(prompt, "the prompt")
    if values.get("system"):
        values["system"] = utf8_text(values["system"], "--system")
    if not prompt.strip():
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    # a running `ssd-chat serve` has the models loaded: ask it before even importing torch
    from .server_client import ask_via_server

    served = ask_via_server(server, no_server, _merge(ctx, local), values, prompt, json_out, format_stats if stats else None)
    if served is not None:
        raise typer.Exit(served)
    from .engine.errors import ParamError, SSDChatError

    try:
        params = sampling_params(values)
        engine = load_engine(values)
    except ParamError as e:  # a setting out of range is bad usage
        raise fail(str(e), 2) from None
    except SSDChatError as e:
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    code = 0
    try:
        code = _answer(engine, prompt, values, params, json_out, stats)
    except SSDChatError as e:  # raised while setting up the decoder, before any token
        raise fail(str(e)) from None
    except KeyboardInterrupt:
        if not json_out:
            sys.stdout.write("\n")
        sys.stdout.flush()
        code = 130
    finally:
        engine.close()
    raise typer.Exit(code)


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
                    "precision": precision_of(engine),
                    "finish_reason": ev.reason,
                    "stats": {
                        "new_tokens": s.new_tokens, "rounds": s.rounds, "tok_per_s": s.tok_per_s, "ttft_s": s.ttft_s,
                        "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
                        "cache_hit_rate": s.cache_hit_rate,
                    },
                }
                sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
            else:
                sys.stdout.write(ev.text[len(streamed):] + "\n")
            sys.stdout.flush()
            if stats:
                typer.echo(format_stats(s), err=True)
    return 0


def precision_of(engine) -> dict[str, str | None]:
    """What the target's (and the draft's, when one drafted) linears computed in: ``gguf Q4_1``, ``float32``."""
    from .engine.precision import of

    uses_draft = engine.draft is not None and engine.config.mode != "ar"
    return {"target": of(engine.target), "draft": of(engine.draft) if uses_draft else None}


def ran_as(stats) -> str:
    from .tui.figures import ran_as as _ran_as

    return _ran_as(stats)


def _fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def format_stats(s) -> str:
    parts = [f"{s.label.lower()}: {s.new_tokens} token{'' if s.new_tokens == 1 else 's'}", f"{_fmt(s.tok_per_s, '.1f')} tok/s", f"TTFT {_fmt(s.ttft_s, '.2f')} s"]
    if s.mean_accepted_length is not None:
        parts += [f"accepted length {s.mean_accepted_length:.2f}", f"acceptance {_fmt(s.acceptance_rate, '.0%')}"]
    if s.cache_hit_rate is not None:
        parts.append(f"cache hits {s.cache_hit_rate:.0%}")
    return ", ".join(parts)


@app.command()
def models(json_out: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List the model aliases and which models are available locally."""
    from .engine.models import cache_dir, local_status

    rows = local_status()
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.table import Table

    table = Table(title="ssd-chat models", title_justify="left")
    table.add_column("alias", no_wrap=True)
    table.add_column("source", overflow="fold")
    table.add_column("local", justify="center")
    table.add_column("where", overflow="fold")
    for r in rows:
        table.add_row(r["alias"] + (" (default)" if r["default"] else ""), r["source"], "yes" if r["local"] else "no", r["where"])
    out = console()
    out.print(table)
    out.print(
        f"Also accepted: any hub id (org/name), a local transformers folder, a .gguf file; drafts derived from the target: copy, int8, layers:N; the drafts shipped for the packaged model: trained, features.\n"
        f"Converted GGUF models are cached in {cache_dir()}; hub downloads honour HF_HOME and HF_HUB_OFFLINE."
    )


from .bench import make_bench_command  # noqa: E402 - needs the option aliases above

app.command("bench")(make_bench_command())
from .draft_cmd import draft_app  # noqa: E402

app.add_typer(draft_app, name="draft")

from .commands import register as _register_app_commands  # noqa: E402 - demo, config, chats

_register_app_commands(app)
from .serve_cmd import register as _register_serve  # noqa: E402

_register_serve(app)


def main() -> None:
    """Console-script entry point: usage errors exit 2, runtime failures 1, Ctrl-C 130."""
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        sys.exit(130)
