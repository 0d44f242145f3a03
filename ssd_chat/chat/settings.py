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
import functools
import os
import tomllib
from pathlib import Path
from typing import Any

from . import settings_file as toml
from ..engine import EngineConfig, user_dir, SamplingParams

DEFAULTS: dict[str, Any] = {
    "target": "smollm2-135m-gguf",
    "draft": None,
    "mode": "auto",  # SSD where it can run (engine/startup/preflight.py), else AR with the reason
    "k": None,
    # sampling: unset (None) takes the model's generation_config, else the chat default (engine/load/gen_defaults.py)
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
    "compile": None,  # the engine's default: auto (compiled where it measured faster)
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


def sampling(values: dict[str, Any]) -> SamplingParams:
    """The sampling settings among ``values``, checked; those unset take the model's defaults once it has
    loaded (:meth:`SamplingParams.over`), else SamplingParams' own (greedy, no penalty: bench and compare)."""
    return SamplingParams.given({k: values.get(k) for k in SAMPLING_KEYS})


def engine_config(values: dict[str, Any]) -> EngineConfig:
    return EngineConfig.from_settings(values)


ENV_PREFIX = "SSD_CHAT_"


class ConfigError(ValueError):
    """A setting in the environment or the config file is unusable; ``str()`` says which and why.
    ``usage``: every setting to blame was given on the command line (bad usage, exit 2)."""

    def __init__(self, message: str, usage: bool = False, keys: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.usage = usage
        self.keys = keys  # the settings to blame


def config_file() -> Path:
    return user_dir("SSD_CHAT_CONFIG_DIR", "XDG_CONFIG_HOME", ".config") / "config.toml"


def env_name(key: str) -> str:
    return ENV_PREFIX + key.upper()


@functools.cache
def _adapter(kind: type) -> Any:
    from pydantic import TypeAdapter  # here, not at import: importing pydantic costs a start ~0.1-0.2 s

    return TypeAdapter(kind)


_WANTS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _coerce(key: str, raw: Any, where: str) -> Any:
    """Turn a raw value into the setting's type.  Text (an environment variable, ``config set``) is
    parsed; a TOML value must already be of the type (strict: ``true`` is no integer, ``3`` no flag)."""
    kind = TYPES.get(key, str)
    if type(raw) is kind:  # what strict validation would return; most files are only this, and skip importing pydantic
        return raw
    from pydantic import ValidationError

    text = isinstance(raw, str)
    try:
        return _adapter(kind).validate_python(raw.strip() if text and kind is not str else raw, strict=not text)
    except ValidationError:
        raise ConfigError(f"{where}: '{key}' must be {_WANTS[kind]}, got {raw!r}") from None


def _raw_file(path: Path) -> dict[str, Any]:
    """The file's TOML table as written (an absent file is empty); a ConfigError for a file that cannot be read."""
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"the config folder {path.parent} is a file, not a folder (set by SSD_CHAT_CONFIG_DIR or XDG_CONFIG_HOME)")
    if path.exists() and not path.is_file():
        raise ConfigError(f"the config file {path} is not a file (a folder?); remove it or point SSD_CHAT_CONFIG_DIR elsewhere")
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e


def read_file(path: Path | None = None, problems: dict[tuple[str, str], tuple[Any, str]] | None = None) -> dict[str, Any]:
    """The settings in the config file (an absent file is empty).  With ``problems``, an entry that is
    not a setting or not of its type is left out and recorded there, ``("file", key)`` -> (value as
    written, why), and a file that cannot be read as ``("file", "")``, instead of raised, so that
    ``ssd-chat config`` can show them."""
    path = path or config_file()
    out: dict[str, Any] = {}
    try:
        data = _raw_file(path)
    except ConfigError as e:
        if problems is None:
            raise
        problems[("file", "")], data = (None, str(e)), {}
    for raw_key, value in data.items():
        key = raw_key.replace("-", "_")
        try:
            if key not in DEFAULTS:
                raise ConfigError(f"unknown setting '{raw_key}' in {path} (known: {', '.join(DEFAULTS)})")
            out[key] = _coerce(key, value, str(path))
        except ConfigError as e:
            if problems is None:
                raise
            problems[("file", raw_key)] = (value, str(e))
    return out


def resolve(cli_values: dict[str, Any], path: Path | None = None,
            problems: dict[tuple[str, str], tuple[Any, str]] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Merge CLI values (None = not given) with environment, file and defaults.

    Returns (values, sources) where sources[key] is "cli", "env", "file" or "default".
    Keys in ``cli_values`` that are not settings pass through unchanged.  With ``problems`` (see
    :func:`read_file`), unusable file and environment values are recorded there and left out.
    """
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    file_values = read_file(path, problems)
    for key, default in DEFAULTS.items():
        env = os.environ.get(env_name(key))
        if env is not None and env != "" and cli_values.get(key) is None:
            try:
                env = _coerce(key, env, f"environment variable {env_name(key)}")
            except ConfigError as e:
                if problems is None:
                    raise
                problems[("env", env_name(key))], env = (env, str(e)), None
        if cli_values.get(key) is not None:
            values[key], sources[key] = cli_values[key], "cli"
        elif env is not None and env != "":
            values[key], sources[key] = env, "env"
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
    from ..engine import ParamError

    def build(vals: dict[str, Any]) -> None:
        engine_config(vals)
        sampling(vals)

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
        raise ConfigError(f"{e} ({where})" if where else str(e), usage=bool(blamed) and all(sources[k] == "cli" for k in blamed),
                          keys=tuple(blamed)) from None
    _check_devices(values, sources, path)


def _check_devices(values: dict[str, Any], sources: dict[str, str], path: Path | None) -> None:
    """The spelling of --target-device / --draft-device, before torch loads or the app opens (the
    hardware is checked when the models load)."""
    from ..engine import DeviceError, check_forms

    for key in ("target_device", "draft_device"):
        try:
            check_forms(*((values.get(key), None) if key == "target_device" else (None, values.get(key))))
        except DeviceError as e:
            source = sources.get(key, "default")
            where = "" if source in ("cli", "default") else f" ({_origin(key, source, path)})"
            raise ConfigError(f"{e}{where}", usage=source == "cli") from None


def fix_hint(e: ConfigError, sources: dict[str, str]) -> str:
    """How to remove the values ``e`` blames that the config file or the environment set."""
    return "; ".join([f"`ssd-chat config unset {k}` removes it from the file" for k in e.keys if sources.get(k) == "file"]
                     + [f"unset {env_name(k)}" for k in e.keys if sources.get(k) == "env"])


def problem_lines(problems: dict[tuple[str, str], tuple[Any, str]]) -> list[str]:
    """One line per unusable entry that :func:`resolve` left out ((source, name) -> (value, why); see
    :func:`read_file`), with how to remove it."""
    out = []
    for (source, name), (_, message) in problems.items():
        if source == "env":
            fix = f"not used; unset {name}"
        elif name:
            fix = f"not used; `ssd-chat config unset {name}` removes it"
        else:
            fix = "the file is not used"
        out.append(f"{message} ({fix})")
    return out


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


def set_value(key: str, raw: str | None, path: Path | None = None) -> Path:
    """Write (or with ``raw=None`` remove) one setting in the config file; returns the file's path.

    A value is checked first as the command line checks it (:func:`check_value`) and a bad one is
    refused with the file unchanged; removing works whatever else the file holds (an entry that is not
    a setting too).  The file is rewritten from its parsed contents, so comments in it are not kept.
    """
    key = key.replace("-", "_")
    path = path or config_file()
    data = _raw_file(path)
    written = next((k for k in data if k.replace("-", "_") == key), None)
    if key not in DEFAULTS and not (raw is None and written):
        raise ConfigError(f"unknown setting '{key}' (known: {', '.join(DEFAULTS)})", usage=True)
    if raw is None:
        data.pop(written, None)
    else:
        value = _coerce(key, raw, "value")
        check_value(key, value, read_file(path, {}), path)
        data.pop(written, None)
        data[key] = value
    data = {k: v for k, v in data.items() if v is not None}
    try:
        text = "\n".join(["# ssd-chat settings (see `ssd-chat config`)"] + [f"{toml.key(k)} = {toml.value(v)}" for k, v in data.items()]) + "\n"
        back = tomllib.loads(text)  # what every command will read: the file is replaced only if that is what was meant
        if list(back) != list(data) or (raw is not None and back[key] != data[key]):
            raise ValueError("it does not read back as written")
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot write {key} as TOML: {e}; {path} is unchanged", usage=True) from None
    try:
        toml.replace_file(path, text)
    except OSError as e:  # read-only file or folder, full disk, a folder in the way: one line, not a traceback
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        raise ConfigError(f"cannot write the config file {path}: {e.strerror or e}{where}; nothing was written") from None
    return path


def _engine_error(values: dict[str, Any], ssd: bool) -> Exception | None:
    """The error that would stop these settings before any weight loads (None: none): the engine's and
    sampling's ranges, also those SSD checks when ``ssd`` (``auto`` may pick SSD), and the devices' spelling."""
    from ..engine import DeviceError, ParamError, check_forms

    try:
        engine_config(values)
        sampling(values)
        if ssd:
            engine_config({**values, "mode": "ssd"})
        check_forms(values.get("target_device"), values.get("draft_device"))
    except (ParamError, DeviceError) as e:
        return e
    return None


def check_value(key: str, value: Any, others: dict[str, Any], path: Path) -> None:
    """A ConfigError (usage) when ``value`` for ``key`` would stop a start: out of range on its own, or
    against the other settings in the file (naming them); model names as a start resolves them, without
    loading weights."""
    ssd = key != "mode" and others.get("mode") in (None, "auto", "ssd")
    base = {**DEFAULTS, **others}
    if _engine_error(base, ssd) is not None:  # the file's other values cannot start either: judge this one alone
        base = dict(DEFAULTS)
    e = _engine_error({**base, key: value}, ssd)
    if e is not None:
        clash = [f"{k} = {toml.value(v)}" for k, v in others.items() if k != key and base.get(k) == v
                 and _engine_error({**base, key: value, k: DEFAULTS[k]}, ssd) is None]
        raise ConfigError(f"{e}{' (with ' + ', '.join(clash) + ' in the file)' if clash else ''}; {path} is unchanged", usage=True)
    if key in ("target", "draft") and value:
        from ..engine import resolve_model, SSDChatError, draft_kind

        try:
            if key == "target" or draft_kind(value, others.get("target") or DEFAULTS["target"]) == "model":
                resolve_model(value)
        except SSDChatError as err:
            raise ConfigError(f"{err}; {path} is unchanged", usage=True) from None
