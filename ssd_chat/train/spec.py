"""How a draft is shaped and trained, and the data the training stages hand each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..engine import DraftShape, ParamError

ProgressFn = Callable[[str, int, int, dict[str, float]], None]  # (stage, done, total, info)


def _no_progress(stage: str, done: int, total: int, info: dict[str, float]) -> None:
    pass


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How a draft is shaped and trained.  ``kind``: "layers" (shared first layers + trained
    layers, ``engine/drafts/model.py``) or "features" (EAGLE-style, ``engine/drafts/feature.py``).  ``init_from``
    None: the target's last two layers ("layers") or its last layer ("features")."""

    kind: str = "layers"
    chain: bool = False  # features: also train on the draft's own features (a second pass; ~1.5x the time)
    num_shared: int = 2
    init_from: tuple[int, ...] | None = None
    num_vocab: int = 8192
    steps: int = 480
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    max_new_tokens: int = 128
    gen_batch: int = 128
    temperature: float = 0.8  # of the sampled training answers
    samples: int = 5  # sampled answers per training prompt, besides the greedy one
    fuse_layer: int | None = None  # features: also read the output of the target's first n layers
    feature_noise: float = 0.0  # features: uniform noise of this amplitude on the input features in training
    self_prompts: int = 0  # extra training prompts written by the target itself (answered greedily)
    eval_every: int = 25
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("layers", "features"):
            raise ParamError(f"--kind must be 'layers' or 'features', got '{self.kind}'")
        if self.num_shared < 0:
            raise ParamError(f"--layers must be >= 0, got {self.num_shared}")
        if self.num_vocab < 2:
            raise ParamError(f"--vocab must be at least 2, got {self.num_vocab}")
        if self.fuse_layer is not None and (self.kind != "features" or self.fuse_layer < 0):
            raise ParamError(f"--fuse-layer needs --kind features and a layer >= 0, got {self.fuse_layer} with --kind {self.kind}")
        if self.feature_noise < 0 or (self.feature_noise and self.kind != "features"):
            raise ParamError(f"--feature-noise needs --kind features and a value >= 0, got {self.feature_noise} with --kind {self.kind}")
        for name in ("samples", "self_prompts"):
            if getattr(self, name) < 0:
                raise ParamError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.samples and not self.temperature > 0:
            raise ParamError("--samples needs --temperature > 0 (sampled answers at temperature 0 would all be the greedy one)")
        for name in ("steps", "batch_size", "max_new_tokens", "gen_batch", "eval_every"):
            if getattr(self, name) < 1:
                raise ParamError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ParamError(f"--lr must be > 0, got {self.lr}")
        if self.temperature < 0:
            raise ParamError(f"--temperature must be >= 0, got {self.temperature}")

    @property
    def capture(self) -> int:
        """The hidden state recorded with the answers (``Features.trunk``): the output of the first
        n target layers, the draft's input ("layers") or the fused feature ("features" with ``fuse_layer``)."""
        return self.fuse_layer if self.fuse_layer is not None else self.num_shared

    def shape(self, num_target_layers: int) -> DraftShape:
        if self.kind == "features":
            return DraftShape(0, self.init_from if self.init_from is not None else (num_target_layers - 1,))
        default = tuple(range(max(0, num_target_layers - 2), num_target_layers))
        return DraftShape(self.num_shared, self.init_from if self.init_from is not None else default)


@dataclass(slots=True)
class Example:
    ids: torch.Tensor  # [T] prompt + answer
    start: int  # index of the first answer token


@dataclass(slots=True)
class Features:
    trunk: list[torch.Tensor]  # per example [T-1, H]: the draft's input (output of the shared layers)
    final: list[torch.Tensor]  # per example [T-1, H]: the target's final normed hidden state
    top1: list[torch.Tensor] | None = None  # per example [T-1]: the target's greedy next token (see with_top1)


@dataclass(slots=True)
class TrainResult:
    draft: torch.nn.Module
    shape: DraftShape
    history: list[dict[str, float]] = field(default_factory=list)
    heldout_agreement: float = 0.0
    vocab_coverage: float = 0.0
