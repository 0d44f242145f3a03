"""The command line's shared options and how every command turns them into settings.

The engine and sampling options are spelled once here, as typer aliases, and used by the app,
``ask``, ``bench``, ``compare``, ``demo`` and ``serve``: given before the subcommand
(``ssd-chat --target X ask ...``) or after it.  Unset options are None; :func:`settings` fills
them from the environment, the config file and the defaults, and checks them against the
engine's own ranges.  Which settings belong to the engine and which to sampling is not listed
here: :meth:`EngineConfig.from_settings` and the fields of :class:`SamplingParams` own that
(:mod:`ssd_chat.config`).
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, Optional

import typer


def choice(value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise typer.BadParameter(f"'{value}' is not one of {', '.join(allowed)}")
    return value


# --- shared engine options (CLI > environment > config file > default) ----------------------
Target = Annotated[Optional[str], typer.Option("--target", "-t", help="Target model: alias, hub id org/name, local folder or .gguf file. Default: smollm2-135m-gguf (packaged).", show_default=False)]
Draft = Annotated[Optional[str], typer.Option("--draft", "-d", help="Draft model (same tokenizer as the target), or a draft derived from the target: copy, int8, layers:N, trained / features (the drafts shipped for the packaged model), or a trained draft folder. Default: trained for the packaged model, int8 for others.", show_default=False)]
Mode = Annotated[Optional[str], typer.Option("--mode", "-m", callback=lambda v: choice(v, ("auto", "ar", "sd", "ssd")), help="Decoding: auto (default: SSD where the machine has room for its speculator and there is a draft for the target, else AR; `ssd-chat config` says which and why), ar (autoregressive), sd (speculative), ssd (speculative speculative, Saguaro).", show_default=False)]
K = Annotated[Optional[int], typer.Option("--k", "-k", min=1, max=32, help="Draft tokens per round (SD/SSD).", show_default=False)]
Temperature = Annotated[Optional[float], typer.Option("--temperature", help="0 = greedy (exact token-for-token reproducibility). Sampling options left unset take the model's generation_config, else temperature 0.8, top-p 0.9, top-k 40, repetition penalty 1.1.", show_default=False)]
TopP = Annotated[Optional[float], typer.Option("--top-p", help="Nucleus sampling mass (1 = off).", show_default=False)]
RepetitionPenalty = Annotated[Optional[float], typer.Option("--repetition-penalty", help="Divide the logits of tokens already in the prompt or reply (CTRL, as transformers/vLLM; 1 = off, > 0).", show_default=False)]
FrequencyPenalty = Annotated[Optional[float], typer.Option("--frequency-penalty", help="Subtract this times a token's count in the reply from its logit (OpenAI; -2..2, 0 = off).", show_default=False)]
PresencePenalty = Annotated[Optional[float], typer.Option("--presence-penalty", help="Subtract this from the logit of every token already in the reply (OpenAI; -2..2, 0 = off).", show_default=False)]
TopK = Annotated[Optional[int], typer.Option("--top-k", min=0, help="Sample from the k most likely tokens (0 = off).", show_default=False)]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Random seed for sampling.", show_default=False)]
MaxNew = Annotated[Optional[int], typer.Option("--max-new-tokens", "-n", min=1, help="Most tokens in one reply.", show_default=False)]
TargetDevice = Annotated[Optional[str], typer.Option("--target-device", help="auto, cpu, cpu:N, cuda, cuda:N, cuda:0-3 or cuda:0,cuda:1 (several GPUs), pipeline:cuda:0,cuda:1, mps (docs/multi-gpu.md).", show_default=False)]
DraftDevice = Annotated[Optional[str], typer.Option("--draft-device", help="Device for the draft / SSD speculator (one device: cpu, cpu:N, cpu:N-M, cuda:N, mps).", show_default=False)]
Dtype = Annotated[Optional[str], typer.Option("--dtype", help="auto (a GGUF on the CPU computes in its own quantized blocks; otherwise bf16 on GPU, fp32 on CPU), float32, bfloat16, float16.", show_default=False)]
FanOut = Annotated[Optional[str], typer.Option("--fan-out", help="SSD fan-out: geometric, uniform:F, or a list like 3,3,2,2,1.", show_default=False)]
Budget = Annotated[Optional[int], typer.Option("--budget", min=1, help="SSD cache budget B: outcomes pre-speculated per round.", show_default=False)]
SaguaroC = Annotated[Optional[float], typer.Option("--saguaro-c", min=0.0, max=1.0, help="Saguaro down-weighting C of the draft's top tokens at temperature > 0 (1 = off).", show_default=False)]
Fallback = Annotated[Optional[str], typer.Option("--fallback", callback=lambda v: choice(v, ("neural", "fast", "auto")), help="SSD fallback on a cache miss: neural, fast or auto.", show_default=False)]
Compile = Annotated[Optional[str], typer.Option("--compile", callback=lambda v: choice(v, ("auto", "on", "off", "transformers")), help="Which forward runs the models: the compact model core eager (off), compiled per row shape (on: CUDA graphs on a GPU; on CPU AOTInductor packages built once per machine and model, about a minute per shape the first time), compiled where it measured faster (auto, default: everything on a GPU; on CPU a 4-bit GGUF target, through torch's int4 kernels), or transformers' own modules (transformers: the reference path). Models the core does not run use transformers, with a notice.", show_default=False)]
TrustRemote = Annotated[Optional[bool], typer.Option("--trust-remote-code/--no-trust-remote-code", help="Allow model repositories to run their own Python code (off by default).", show_default=False)]
System = Annotated[Optional[str], typer.Option("--system", "-s", help="System prompt.", show_default=False)]


def merge(ctx: typer.Context, local: dict[str, Any]) -> dict[str, Any]:
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


def fail(message: str, code: int = 1) -> typer.Exit:
    """One line on stderr, and the exit to raise: usage errors 2, runtime failures 1."""
    from .terminal import wrapped

    typer.echo(wrapped(f"ssd-chat: error: {message}", sys.stderr), err=True)
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


def console() -> Any:
    """A Rich console for tables: on a terminal its width; in a pipe or a file wide enough that names and
    paths are never cut short (Rich would assume 80 columns)."""
    from rich.console import Console

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=1000)
