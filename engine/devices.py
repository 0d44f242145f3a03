"""Where a model runs: ``--target-device`` / ``--draft-device`` and ``--dtype`` checked against the
hardware present (:func:`parse_placement`), as a :class:`Placement` that :func:`models.load` follows.
The forms themselves (device lists, ranges, ``pipeline:``) are read by :mod:`placement`."""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass

import torch

from .errors import DeviceError


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
class Placement:
    """Where a model runs.  ``cores`` is set for ``cpu:N`` style pinning (SSD workers; for CPU ranks,
    all their cores).  ``ranks``: tensor parallelism, one rank per device (rank 0 is ``device``, in
    this process), each CPU rank on its ``rank_cores``; ``device_map``: a transformers pipeline."""

    device: torch.device
    dtype: torch.dtype
    cores: tuple[int, ...] | None = None
    device_map: tuple[str, ...] | None = None  # pipeline: several GPUs for one model, one at work at a time
    ranks: tuple[str, ...] | None = None
    rank_cores: tuple[tuple[int, ...], ...] | None = None

    @property
    def label(self) -> str:
        if self.ranks:
            from .placement import TargetPlan

            where = TargetPlan("tp", self.ranks, self.rank_cores).label
        else:
            where = ",".join(self.device_map) if self.device_map else str(self.device)
            if self.cores is not None:
                where += f" (cores {','.join(map(str, self.cores))})"
        return f"{where} {str(self.dtype).removeprefix('torch.')}"


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}


def parse_placement(device: str = "auto", dtype: str = "auto", option: str = "--target-device") -> Placement:
    """Validate ``--*-device`` / ``--dtype`` (``auto``, ``cpu``, ``cpu:1``, ``cpu:0-3``, ``cuda``, ``cuda:N``,
    ``mps``; for the target also ``cuda:0-3``, ``cuda:0,cuda:1``, ``pipeline:cuda:0,cuda:1``: see :mod:`placement`)
    against the hardware present; errors name ``option``, the one the user gave."""
    spec = (device or "auto").strip().lower()
    if spec == "auto" and option == "--target-device" and torch.cuda.is_available() and torch.cuda.device_count() >= 3:
        from .placement import plan_target

        spec = ",".join(plan_target("auto", gpus=torch.cuda.device_count()).devices)  # TP over all GPUs but the last
    if "," in spec or spec.startswith("pipeline:") or re.fullmatch(r"cuda:\d+-\d+", spec):
        return _several(spec, device, dtype, option)
    cores = None
    devs: list[str]
    devs = ["cuda:0" if torch.cuda.is_available() else "cpu"] if spec == "auto" else [spec]
    parsed: list[torch.device] = []
    for d in devs:
        m = re.fullmatch(r"cpu(?::(\d+)(?:-(\d+))?)?", d)
        if m:
            if m.group(1) is not None:
                lo = int(m.group(1))
                hi = int(m.group(2)) if m.group(2) else lo
                avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
                want = tuple(range(lo, hi + 1))
                missing = [c for c in want if c not in avail]
                if missing or hi < lo:
                    raise DeviceError(f"{option} {d}: this machine has CPU cores {avail[0]}-{avail[-1]} only")
                cores = want
            parsed.append(torch.device("cpu"))
            continue
        m = re.fullmatch(r"cuda(?::(\d+))?", d)
        if m:
            if not torch.cuda.is_available():
                raise DeviceError(
                    f"{option} {d}: no CUDA GPU is available "
                    f"(torch {torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); use {option} cpu"
                )
            idx = int(m.group(1) or 0)
            if idx >= torch.cuda.device_count():
                raise DeviceError(f"{option} {d}: no such device, this machine has {torch.cuda.device_count()} CUDA GPU(s)")
            parsed.append(torch.device("cuda", idx))
            continue
        if d == "mps":
            if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
                raise DeviceError(f"{option} mps: Apple Metal is not available")
            parsed.append(torch.device("mps"))
            continue
        raise DeviceError(f"{option}: unknown device '{d}' (use cpu, cpu:N, cuda, cuda:N, cuda:0,cuda:1 or mps)")
    return Placement(parsed[0], _dtype(dtype, parsed[0]), cores)


def _several(spec: str, given: str, dtype: str, option: str) -> Placement:
    """A device list or range (see :mod:`placement`): tensor parallelism (one rank per GPU or per
    listed CPU core set), or with ``pipeline:`` transformers' device_map over the GPUs."""
    from .placement import parse_devices

    plan = parse_devices(spec, given, option)
    if plan.kind == "single":  # cuda:1-1, cpu:0-3
        return parse_placement(plan.devices[0], dtype, option)
    if option != "--target-device":
        raise DeviceError(f"{option} {given}: the draft runs on one device (list several for the target only)")
    first = torch.device(plan.devices[0])
    if plan.kind == "pipeline":
        return Placement(first, _dtype(dtype, first), None, plan.devices)
    cores = tuple(c for rank in plan.cores for c in rank) if plan.cores else None
    return Placement(first, _dtype(dtype, first), cores, ranks=plan.devices, rank_cores=plan.cores)


def _dtype(dtype: str, first: torch.device) -> torch.dtype:
    dt = (dtype or "auto").strip().lower()
    if dt == "auto":
        torch_dtype = torch.bfloat16 if first.type == "cuda" else torch.float32
    elif dt in _DTYPES:
        torch_dtype = _DTYPES[dt]
    else:
        raise DeviceError(f"unknown dtype '{dtype}' (use auto, float32, bfloat16, float16)")
    return torch_dtype
