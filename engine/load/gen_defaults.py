"""The sampling settings a reply uses when the user sets none: the model's own, else a chat default.

A model folder's ``generation_config.json`` may declare ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty`` and ``do_sample``; those declared are used, as vLLM does
(``do_sample: false`` means greedy).  A config transformers derived from the model config
(``_from_model_config``) declares nothing.  Where the model declares nothing (the packaged GGUF),
:data:`CHAT_DEFAULT` applies: sampling with a mild repetition penalty, as Ollama's defaults, because
greedy decoding of small models loops (one line repeated to the token limit), and that loop then
stays in the chat's context.  Benchmarks and ``compare`` stay greedy: they never read these.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1); measured on the
# packaged model in docs/design.md ("Sampling defaults and penalties")
CHAT_DEFAULT: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
KEYS = ("temperature", "top_p", "top_k", "repetition_penalty")


def declared(folder: Path | None) -> dict[str, Any] | None:
    """The sampling settings ``folder/generation_config.json`` declares (None: it declares none)."""
    if folder is None:
        return None
    path = Path(folder) / "generation_config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("_from_model_config"):
        return None
    out: dict[str, Any] = {}
    for key in KEYS:
        v = data.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = int(v) if key == "top_k" else float(v)
    if data.get("do_sample") is False:
        out["temperature"] = 0.0
    elif data.get("do_sample") is True and "temperature" not in out:
        out["temperature"] = 1.0  # transformers' default when sampling
    if not out:
        return None
    if out.get("top_k", 0) < 0:
        out["top_k"] = 0
    if not (0.0 < out.get("top_p", 1.0) <= 1.0):
        out.pop("top_p")
    if not (out.get("repetition_penalty", 1.0) > 0):
        out.pop("repetition_penalty")
    if out.get("temperature", 0.0) < 0:
        out.pop("temperature")
    return out


def for_model(folder: Path | None) -> tuple[dict[str, Any], str]:
    """(settings, where they come from) for a model's replies when the user sets none."""
    own = declared(folder)
    if own is not None:
        return own, "the model's generation_config.json"
    return dict(CHAT_DEFAULT), "ssd-chat's chat default (the model declares none)"
