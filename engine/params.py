"""Generation settings shared by every decoder."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .errors import ParamError

MAX_LOGPROBS = 20  # the most alternatives per token a reply's logprobs show (vLLM's default, OpenAI's top_logprobs)
SEED_MAX = 2**63 - 1  # the decoders derive seed + 1 and 2 * seed + 1, which torch takes up to 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy decoding (argmax); top-p / top-k then have no effect.
    ``seed`` makes sampling reproducible (None: a fresh random seed per reply).
    The one type of the sampling settings from the command line (:meth:`given`) to the speculator;
    its values are checked once, here, whoever builds or replaces it.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks only: generate exactly max_new_tokens
    # penalties, as vLLM: repetition (CTRL / transformers) over prompt + reply, frequency and presence
    # (OpenAI) over the reply's tokens; 1.0 / 0.0 / 0.0 are off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # report the target's logprob of each emitted token and its top-N alternatives (N = 0..20); None: off
    logprobs: int | None = None
    # the fields the user set (flag, environment, config file); a model's defaults fill the others (:meth:`over`)
    chosen: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def given(cls, values: Mapping[str, Any]) -> SamplingParams:
        """From settings, those unset (None) left to :meth:`over` (else this type's defaults)."""
        own = {k: v for k, v in values.items() if v is not None}
        return cls(**own, chosen=frozenset(own))

    def over(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """These settings over ``defaults`` (a model's: ``Engine.sampling_defaults``) where none was chosen."""
        return replace(self, **{k: v for k, v in defaults.items() if k not in self.chosen})

    def choices(self) -> dict[str, Any]:
        """The settings the user chose."""
        return {k: getattr(self, k) for k in self.chosen}

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ParamError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ParamError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ParamError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed <= SEED_MAX:
            raise ParamError(f"seed must be a whole number from 0 to {SEED_MAX} (2^63 - 1), got {self.seed}")
        if self.max_new_tokens < 1:
            raise ParamError(f"max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ParamError("stop strings must not be empty")
        if not (0.0 < self.repetition_penalty < float("inf")):
            raise ParamError(f"repetition-penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ParamError(f"logprobs must be from 0 to {MAX_LOGPROBS} (the top alternatives shown per token), got {self.logprobs}")
        for name, v in (("frequency", self.frequency_penalty), ("presence", self.presence_penalty)):
            if not (-2.0 <= v <= 2.0):
                raise ParamError(f"{name}-penalty must be in [-2, 2] (0 = off), got {v}")
