"""Where SSD's verifier and speculator run.

On CPU the two processes get disjoint cores (each its own torch threads), so the speculator
drafts while the target verifies; on GPUs the draft gets the first GPU the target leaves.  ``Plan.shared`` says
when they share one device or core set (SSD still runs, without real overlap).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from ..load.models import parse_placement


@dataclass(frozen=True)
class Plan:
    """Where the verifier and the speculator run."""

    draft_device: str
    draft_cores: tuple[int, ...] | None
    draft_threads: int | None
    target_cores: tuple[int, ...] | None
    target_threads: int | None
    shared: bool  # one device/core set for both (SSD still runs, with no real overlap)

    @property
    def label(self) -> str:
        d = self.draft_device + (f" (cores {','.join(map(str, self.draft_cores))})" if self.draft_cores else "")
        t = f"cores {','.join(map(str, self.target_cores))}" if self.target_cores else "as loaded"
        return f"speculator on {d}; verifier {t}"


def plan(config: Any, target_device: torch.device, target_cores: tuple[int, ...] | None) -> Plan:
    """Default placement: on CPU the draft gets the last half of the cores (core 1 of 2) and the
    target the rest (core 0); on GPUs the draft gets the first GPU the target does not use.
    Explicit devices win."""
    avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    dspec = (config.draft_device or "auto").strip().lower()
    if dspec == "auto":
        if target_device.type == "cuda":  # the first GPU the target does not use, else its last one, shared
            from ..load.placement import plan_target

            n = torch.cuda.device_count()
            used = plan_target(config.target_device or "auto", gpus=n).devices
            free = [g for g in range(n) if f"cuda:{g}" not in used]
            dev = f"cuda:{free[0]}" if free else used[-1]
            return Plan(dev, None, None, target_cores, len(target_cores) if target_cores else None, not free)
        dspec = "cpu"
    dplace = parse_placement(dspec, "auto")
    if dplace.device.type != "cpu":
        shared = target_device == dplace.device
        return Plan(str(dplace.device), None, None, target_cores, len(target_cores) if target_cores else None, shared)
    dcores = dplace.cores
    if target_device.type != "cpu":
        return Plan("cpu", dcores, len(dcores) if dcores else None, target_cores, None, False)
    if dcores is None:
        if len(avail) < 2:
            return Plan("cpu", None, 1, None, None, True)
        pool = [c for c in avail if not target_cores or c not in target_cores] or avail
        dcores = tuple(pool[len(pool) - max(1, len(pool) // 2) if not target_cores else 0:])
    if target_cores is None:
        target_cores = tuple(c for c in avail if c not in dcores) or tuple(avail)
    shared = bool(set(target_cores) & set(dcores))
    return Plan("cpu", dcores, len(dcores), target_cores, len(target_cores), shared)
