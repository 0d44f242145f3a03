"""Settings typed between replies (the settings dialog, ``/mode ssd`` style commands, the demo script):
the command names and the parsing of what was typed, with a readable message for a bad value."""

from __future__ import annotations

from typing import Any

# /command -> setting (the demo script's command files use the same names)
SLASH_KEYS = {"mode": "mode", "k": "k", "fan-out": "fan_out", "fanout": "fan_out", "temp": "temperature",
              "temperature": "temperature", "max": "max_new_tokens", "max-new-tokens": "max_new_tokens"}
# the settings that change the engine (no reload); the others are sampling settings for the next reply
ENGINE_CHANGES = ("mode", "k", "fan_out")


def parse_settings(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the dialog's text fields; raises ValueError with a readable message."""
    out: dict[str, Any] = {}
    if raw.get("mode"):
        if raw["mode"] not in ("ar", "sd", "ssd"):
            raise ValueError(f"unknown mode '{raw['mode']}' (ar, sd or ssd)")
        out["mode"] = raw["mode"]
    if raw.get("k", "").strip():
        try:
            k = int(raw["k"])
        except ValueError:
            raise ValueError(f"k must be a whole number, got '{raw['k']}'") from None
        if not 1 <= k <= 32:
            raise ValueError(f"k must be between 1 and 32, got {k}")
        out["k"] = k
    if "fan_out" in raw:
        out["fan_out"] = raw["fan_out"].strip() or None
    if raw.get("temperature", "").strip():
        try:
            t = float(raw["temperature"])
        except ValueError:
            raise ValueError(f"temperature must be a number, got '{raw['temperature']}'") from None
        from ..engine.errors import ParamError
        from ..engine.params import SamplingParams

        try:  # the engine's rule, as on the command line (finite, >= 0)
            SamplingParams(temperature=t)
        except ParamError as e:
            raise ValueError(str(e)) from None
        out["temperature"] = t
    if raw.get("max_new_tokens", "").strip():
        try:
            n = int(raw["max_new_tokens"])
        except ValueError:
            raise ValueError(f"max new tokens must be a whole number, got '{raw['max_new_tokens']}'") from None
        if n < 1:
            raise ValueError(f"max new tokens must be at least 1, got {n}")
        out["max_new_tokens"] = n
    return out
