"""The command line's shared options and how every command turns them into settings.

The engine and sampling options are declared once here, in ``ENGINE_OPTIONS``, and given to the app,
``ask``, ``bench``, ``compare``, ``demo`` and ``serve`` by :func:`engine_options`: given before
the subcommand (``ssd-chat --target X ask ...``) or after it.  Unset options are None; :func:`settings` fills
them from the environment, the config file and the defaults, and checks them against the
engine's own ranges.  Which settings belong to the engine and which to sampling is not listed
here: :meth:`EngineConfig.from_settings` and the fields of :class:`SamplingParams` own that
(:mod:`ssd_chat.chat.settings`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Annotated, Any, Optional

import typer

from ..chat.terminal import fail  # noqa: F401 - every command's one-line error


def choice(value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}")
    return value


# --- the engine and sampling options (CLI > environment > config file > default), in the order --help lists them
ENGINE_OPTIONS: dict[str, Any] = {
    "target": Annotated[Optional[str], typer.Option("--target", "-t", help="Target model: alias, hub id org/name, local folder or .gguf file. Default: smollm2-135m-gguf (packaged).", show_default=False)],
    "draft": Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (same tokenizer as the target), or a draft derived from the target: copy, int8, layers:N, trained / features (the drafts shipped for the packaged model), or a trained draft folder. Default: trained for the packaged model, int8 for others.", show_default=False)],
    "mode": Annotated[Optional[str], typer.Option("--mode", "-m", callback=lambda v: choice(v, ("auto", "ar", "sd", "ssd")), help="Decoding: auto (default: the fastest of AR, SD and SSD as measured on this machine for this model, draft and build, AR unless beaten by > 5 % on a quiet machine; until measured AR, while the app or `serve` measures in the background; `ssd-chat config` says which and why, `ssd-chat config measure` measures again), ar (autoregressive), sd (speculative), ssd (speculative speculative, Saguaro).", show_default=False)],
    "k": Annotated[Optional[int], typer.Option("--k", "-k", min=1, max=32, help="Draft tokens per round (SD/SSD).", show_default=False)],
    "temperature": Annotated[Optional[float], typer.Option("--temperature", help="0 = greedy (exact token-for-token reproducibility). Sampling options left unset take the model's generation_config, else temperature 0.8, top-p 0.9, top-k 40, repetition penalty 1.1.", show_default=False)],
    "top_p": Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", show_default=False)],
    "top_k": Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0 = off).", show_default=False)],
    "seed": Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.", show_default=False)],
    "repetition_penalty": Annotated[Optional[float], typer.Option("--repetition-penalty", help="Divide the logits of tokens already in the prompt or reply (CTRL, as transformers/vLLM; 1 = off, > 0).", show_default=False)],
    "frequency_penalty": Annotated[Optional[float], typer.Option("--frequency-penalty", help="Subtract this times a token's count in the reply from its logit (OpenAI; -2..2, 0 = off).", show_default=False)],
    "presence_penalty": Annotated[Optional[float], typer.Option("--presence-penalty", help="Subtract this from the logit of every token already in the reply (OpenAI; -2..2, 0 = off).", show_default=False)],
    "max_new_tokens": Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens in one reply.", show_default=False)],
    "target_device": Annotated[Optional[str], typer.Option("--target-device", help="auto, cpu, cpu:N, cuda, cuda:N, cuda:0-3 or cuda:0,cuda:1 (several GPUs), pipeline:cuda:0,cuda:1, mps (docs/multi-gpu.md).", show_default=False)],
    "draft_device": Annotated[Optional[str], typer.Option("--draft-device", help="Device for the draft / SSD speculator (one device: cpu, cpu:N, cpu:N-M, cuda:N, mps).", show_default=False)],
    "dtype": Annotated[Optional[str], typer.Option("--dtype", help="auto (a GGUF on the CPU computes in its own quantized blocks; otherwise bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.", show_default=False)],
    "fan_out": Annotated[Optional[str], typer.Option("--fan-out", help="SSD fan-out: geometric, uniform:F, or a list like 3,3,2,2,1.", show_default=False)],
    "budget": Annotated[Optional[int], typer.Option("--budget", min=1, help="SSD cache budget B: outcomes pre-speculated per round.", show_default=False)],
    "saguaro_c": Annotated[Optional[float], typer.Option("--saguaro-c", min=0.0, max=1.0, help="Saguaro down-weighting C of the draft's top tokens at temperature > 0 (1 = off).", show_default=False)],
    "fallback": Annotated[Optional[str], typer.Option("--fallback", callback=lambda v: choice(v, ("neural", "fast", "auto")), help="SSD fallback on a cache miss: neural, fast or auto.", show_default=False)],
    "compile": Annotated[Optional[str], typer.Option("--compile", callback=lambda v: choice(v, ("auto", "on", "off", "transformers")), help="Which forward runs the models: the compact model core eager (off), compiled per row shape (on: CUDA graphs on a GPU; on CPU AOTInductor packages built once per machine and model, about a minute per shape the first time), compiled where it measured faster (auto, default: everything on a GPU; on CPU a 4-bit GGUF target, through torch's int4 kernels), or transformers' own modules (transformers: the reference path). Models the core does not run use transformers, with a notice.", show_default=False)],
    "trust_remote_code": Annotated[Optional[bool], typer.Option("--trust-remote-code/--no-trust-remote-code", help="Allow model repositories to run their own Python code (off by default).", show_default=False)],
    "system": Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.", show_default=False)],
}
SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty", "presence_penalty")


def engine_options(exclude: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command the engine options (less ``exclude``) in place of its ``given`` parameter.

    Typer reads a command's options from its signature: the wrapper's signature lists them where
    ``given`` stands, so ``--help`` shows them there.  The command receives, as ``given``, the
    options given before the subcommand updated with those given after it (None: not given).
    """
    names = [n for n in ENGINE_OPTIONS if n not in exclude]
    keyword = inspect.Parameter.KEYWORD_ONLY

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(command, eval_str=True)
        # the options given before the subcommand are in ctx.obj; typer passes the context to a parameter typed so
        ctx_name = next((p.name for p in sig.parameters.values() if p.annotation is typer.Context), None)
        params: list[inspect.Parameter] = [] if ctx_name else [inspect.Parameter("ctx_", keyword, annotation=typer.Context)]
        for p in sig.parameters.values():
            if p.name == "given":
                params += [inspect.Parameter(n, keyword, default=None, annotation=ENGINE_OPTIONS[n]) for n in names]
            else:
                params.append(p.replace(kind=keyword))

        @functools.wraps(command)
        def run(**kwargs: Any) -> Any:
            local = {n: kwargs.pop(n) for n in names}
            ctx = kwargs[ctx_name] if ctx_name else kwargs.pop("ctx_")
            return command(**kwargs, given=merge(ctx.obj, local))

        run.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in params}
        return run

    return decorate


def merge(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Options given after the subcommand win over those given before it."""
    return {**(before or {}), **{k: v for k, v in after.items() if v is not None}}


def settings(values: dict[str, Any]) -> dict[str, Any]:
    """Fill unset options from the environment/config file and the defaults; the sampling settings
    become one checked SamplingParams, ``["sampling"]``."""
    from ..chat import settings as config

    try:
        resolved, sources = config.resolve(values)
        config.check(resolved, sources)
    except config.ConfigError as e:  # one line naming the flag, SSD_CHAT_* variable or config.toml entry
        raise fail(str(e), 2 if e.usage else 1) from None
    resolved["sampling"] = config.sampling({k: resolved.pop(k) for k in config.SAMPLING_KEYS})
    return resolved


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


def console() -> Any:
    """A Rich console for tables: on a terminal its width; in a pipe or a file wide enough that names and
    paths are never cut short (Rich would assume 80 columns)."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=1000)
