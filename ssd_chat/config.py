"""Settings: CLI > environment > config file (TOML) > built-in defaults.

The file is ``$SSD_CHAT_CONFIG_DIR/config.toml`` (default ``$XDG_CONFIG_HOME/ssd-chat/config.toml``,
i.e. ``~/.config/ssd-chat/config.toml``).  Its keys are the long option names with
underscores (dashes are accepted too), e.g.::

    target = "llama-3-8b"
    mode = "ssd"
    max_new_tokens = 256

Each setting can also come from the environment as ``SSD_CHAT_<KEY>`` (``SSD_CHAT_MODE=sd``,
``SSD_CHAT_MAX_NEW_TOKENS=64``).  ``ssd-chat config`` prints the resolved values and where
each one came from.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from .engine.config import EngineConfig
from .engine.params import SamplingParams

DEFAULTS: dict[str, Any] = {
    "target": "smollm2-135m-gguf",
    "draft": None,
    "mode": "auto",  # SSD where it can run (engine/preflight.py), else AR with the reason
    "k": None,
    # sampling: unset (None) takes the model's generation_config, else the chat default (engine/gen_defaults.py)
    "temperature": None,
    "top_p": None,
    "top_k": None,
    "repetition_penalty": None,
    "frequency_penalty": None,
    "presence_penalty": None,
    "seed": None,
    "max_new_tokens": 512,
    "target_device": "auto",
    "draft_device": "auto",
    "dtype": "auto",
    "fan_out": None,
    "budget": None,
    "saguaro_c": None,
    "fallback": None,
    "compile": None,  # the engine's default: off (the compact core, eager)
    "trust_remote_code": False,
    "system": None,
    # chat app
    "colour_tokens": False,
    "db": None,
}

# what each setting is, for `ssd-chat config` and error messages
TYPES: dict[str, type] = {
    "k": int, "top_k": int, "seed": int, "max_new_tokens": int, "budget": int,
    "temperature": float, "top_p": float, "saguaro_c": float,
    "repetition_penalty": float, "frequency_penalty": float, "presence_penalty": float,
    "trust_remote_code": bool, "colour_tokens": bool,
}

# the settings that are sampling parameters (stop strings and ignore_eos are SamplingParams fields, not settings)
SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name in DEFAULTS)


def sampling_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings among ``values`` that are set."""
    return {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}


def sampling_params(values: dict[str, Any], model_defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The settings that are set, over ``model_defaults`` (the loaded model's: ``Engine.sampling_defaults``),
    over SamplingParams' own (greedy, no penalty: what bench and compare use)."""
    return SamplingParams(**{**(model_defaults or {}), **sampling_settings(values)})


def engine_config(values: dict[str, Any]) -> EngineConfig:
    return EngineConfig.from_settings(values)


ENV_PREFIX = "SSD_CHAT_"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    """A setting in the environment or the config file is unusable; ``str()`` says which and why.
    ``usage``: every setting to blame was given on the command line (bad usage, exit 2)."""

    def __init__(self, message: str, usage: bool = False) -> None:
        super().__init__(message)
        self.usage = usage


def config_dir() -> Path:
    env = os.environ.get("SSD_CHAT_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "ssd-chat"


def config_file() -> Path:
    return config_dir() / "config.toml"


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


def _coerce(key: str, raw: Any, where: str) -> Any:
    """Turn a raw value (an env string or a TOML value) into the setting's type."""
    kind = TYPES.get(key, str)
    if isinstance(raw, str) and kind is not str:
        text = raw.strip()
        if kind is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ConfigError(f"{where}: '{key}' must be true or false, got '{raw}'")
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{where}: '{key}' must be {'an integer' if kind is int else 'a number'}, got '{raw}'") from None
    if kind is bool and not isinstance(raw, bool):
        raise ConfigError(f"{where}: '{key}' must be true or false, got {raw!r}")
    if kind is int and (isinstance(raw, bool) or not isinstance(raw, int)):
        raise ConfigError(f"{where}: '{key}' must be an integer, got {raw!r}")
    if kind is float:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise ConfigError(f"{where}: '{key}' must be a number, got {raw!r}")
        return float(raw)
    if kind is str and not isinstance(raw, str):
        raise ConfigError(f"{where}: '{key}' must be a string, got {raw!r}")
    return raw


def read_file(path: Path | None = None) -> dict[str, Any]:
    """The settings in the config file (an absent file is empty)."""
    path = path or config_file()
    if not path.is_file():
        return {}
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        if key not in DEFAULTS:
            raise ConfigError(f"unknown setting '{raw_key}' in {path} (known: {', '.join(DEFAULTS)})")
        out[key] = _coerce(key, value, str(path))
    return out


def resolve(cli_values: dict[str, Any], path: Path | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge CLI values (None = not given) with environment, file and defaults.

    Returns (values, sources) where sources[key] is "cli", "env", "file" or "default".
    Keys in ``cli_values`` that are not settings pass through unchanged.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values = read_file(path)
    for key, default in DEFAULTS.items():
        env = os.environ.get(env_name(key))
        if cli_values.get(key) is not None:
            values[key], sources[key] = cli_values[key], "cli"
        elif env is not None and env != "":
            values[key], sources[key] = _coerce(key, env, f"environment variable {env_name(key)}"), "env"
        elif key in file_values:
            values[key], sources[key] = file_values[key], "file"
        else:
            values[key], sources[key] = default, "default"
    for key, v in cli_values.items():  # options that are not settings pass through
        values.setdefault(key, v)
    return values, sources


def check(values: dict[str, Any], sources: dict[str, str], path: Path | None = None) -> None:
    """ConfigError when resolved settings are out of range, naming where each value to blame came
    from.  The ranges are the engine's own (EngineConfig, SamplingParams): a value is to blame when
    putting its default back makes the error go away."""
    from .engine.errors import ParamError

    def build(vals: dict[str, Any]) -> None:
        engine_config(vals)
        sampling_params(vals)

    def passes(vals: dict[str, Any]) -> bool:
        try:
            build(vals)
        except ParamError:
            return False
        return True

    try:
        build(values)
    except ParamError as e:
        blamed = [k for k in DEFAULTS if sources.get(k, "default") != "default" and passes({**values, k: DEFAULTS[k]})]
        if len(blamed) > 1:  # AR checks no SSD knobs, so the mode is to blame only when nothing else is
            blamed = [k for k in blamed if k != "mode"]
        where = ", ".join(_origin(k, sources[k], path) for k in blamed)
        raise ConfigError(f"{e} ({where})" if where else str(e), usage=bool(blamed) and all(sources[k] == "cli" for k in blamed)) from None
    _check_devices(values, sources, path)


def _check_devices(values: dict[str, Any], sources: dict[str, str], path: Path | None) -> None:
    """The spelling of --target-device / --draft-device, before torch loads or the app opens (the
    hardware is checked when the models load)."""
    from .engine.errors import DeviceError
    from .engine.placement import check_forms

    for key in ("target_device", "draft_device"):
        try:
            check_forms(*((values.get(key), None) if key == "target_device" else (None, values.get(key))))
        except DeviceError as e:
            source = sources.get(key, "default")
            where = "" if source in ("cli", "default") else f" ({_origin(key, source, path)})"
            raise ConfigError(f"{e}{where}", usage=source == "cli") from None


def _origin(key: str, source: str, path: Path | None) -> str:
    if source == "cli":
        return f"--{key.replace('_', '-')} on the command line"
    if source == "env":
        return f"{key} from environment variable {env_name(key)}"
    return f"{key} from config file {path or config_file()}"


def describe_source(key: str, source: str, path: Path | None = None) -> str:
    """A source with its detail, e.g. ``env SSD_CHAT_MODE`` or ``file ~/.config/ssd-chat/config.toml``."""
    if source == "env":
        return f"env {env_name(key)}"
    if source == "file":
        return f"file {path or config_file()}"
    return source


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def set_value(key: str, raw: str | None, path: Path | None = None) -> Path:
    """Write (or with ``raw=None`` remove) one setting in the config file; returns the file's path.

    The file is rewritten from its parsed contents, so comments in it are not kept.
    """
    key = key.replace("-", "_")
    if key not in DEFAULTS:
        raise ConfigError(f"unknown setting '{key}' (known: {', '.join(DEFAULTS)})")
    path = path or config_file()
    data = read_file(path)
    if raw is None:
        data.pop(key, None)
    else:
        data[key] = _coerce(key, raw, "value")
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["# ssd-chat settings (see `ssd-chat config`)"] + [f"{k} = {_toml_value(v)}" for k, v in data.items() if v is not None]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
