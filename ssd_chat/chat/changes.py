"""Settings typed between replies (the settings dialog, ``/mode ssd`` style commands, the demo script):
the command names and the parsing of what was typed, with a readable message for a bad value."""

from __future__ import annotations

import math
from typing import Any

from ..engine import CONFIG_MODES
from .settings import SAMPLING_KEYS

# /command -> setting (the demo script's command files use the same names)
SLASH_KEYS = {"mode": "mode", "k": "k", "fan-out": "fan_out", "fanout": "fan_out", "temp": "temperature",
              "temperature": "temperature", "max": "max_new_tokens", "max-new-tokens": "max_new_tokens",
              "top-p": "top_p", "top-k": "top_k", "seed": "seed",
              "repeat-penalty": "repetition_penalty", "repetition-penalty": "repetition_penalty"}
# the settings that change the engine (no reload); the others are sampling settings for the next reply
ENGINE_CHANGES = ("mode", "k", "fan_out")

# The settings typed as text, in the settings dialog's order: setting -> (label, type).  A sampling
# parameter's range is checked by SamplingParams itself, so a new one needs only its line here.
FIELDS: dict[str, tuple[str, type]] = {
    "k": ("k (draft tokens per round: SD, SSD)", int),
    "fan_out": ("fan-out (geometric, uniform:F, 3,2,1)", str),
    "temperature": ("temperature (0 = greedy)", float),
    "top_p": ("top-p (1 = off)", float),
    "top_k": ("top-k (0 = off)", int),
    "seed": ("seed (empty: a new one each reply)", int),
    "repetition_penalty": ("repetition penalty (1 = off)", float),
    "max_new_tokens": ("max new tokens", int),
}
# an empty field means the default (None) for these, "unchanged" for the others
EMPTY_IS_DEFAULT = ("fan_out", "seed")


def _name(key: str) -> str:
    return {"max_new_tokens": "max new tokens"}.get(key, key.replace("_", "-"))


def _number(key: str, text: str, kind: type) -> Any:
    try:
        v = kind(text)
    except ValueError:
        raise ValueError(f"{_name(key)} must be {'a whole number' if kind is int else 'a number'}, got '{text}'") from None
    if kind is float and not math.isfinite(v):
        raise ValueError(f"{_name(key)} must be a finite number, got '{text}'")
    return v


def parse_settings(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the dialog's text fields; raises ValueError with a readable message."""
    from ..engine import SamplingParams

    out: dict[str, Any] = {}
    if raw.get("mode"):
        if raw["mode"] not in CONFIG_MODES:
            raise ValueError(f"unknown mode '{raw['mode']}' (ar, sd, ssd or auto)")
        out["mode"] = raw["mode"]
    for key, (_, kind) in FIELDS.items():
        if key not in raw:
            continue
        text = raw[key].strip()
        if not text:
            if key in EMPTY_IS_DEFAULT:
                out[key] = None
            continue
        out[key] = text if kind is str else _number(key, text, kind)
    if "k" in out and not 1 <= out["k"] <= 32:
        raise ValueError(f"k must be between 1 and 32, got {out['k']}")
    if out.get("max_new_tokens") is not None and out["max_new_tokens"] < 1:
        raise ValueError(f"max new tokens must be at least 1, got {out['max_new_tokens']}")
    SamplingParams(**{k: v for k, v in out.items() if k in SAMPLING_KEYS and v is not None})  # its own ranges, in words
    return out


def check_engine(values: dict[str, Any], current: dict[str, Any]) -> None:
    """The engine's checks (k against the fan-out, in SSD) on the settings the dialog would apply; ValueError."""
    from ..engine import EngineConfig

    merged = {**{k: current.get(k) for k in ENGINE_CHANGES}, **values}
    EngineConfig(**{k: v for k, v in merged.items() if k in ENGINE_CHANGES and v is not None})
