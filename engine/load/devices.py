"""Where a model runs: ``--target-device`` / ``--draft-device`` and ``--dtype`` checked against the
hardware present (:func:`parse_placement`), as a :class:`Placement` that :func:`models.load_model` follows.
Every form (one device, lists, ranges, ``pipeline:``) is read by :mod:`placement`'s one grammar."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DeviceError
from .placement import TargetPlan, cores_present, parse_devices, parse_form, plan_target


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
    ``mps``; for the target also ``cuda:0-3``, ``cuda:0,cuda:1``, ``pipeline:cuda:0,cuda:1``: the grammar is
    :mod:`placement`'s) against the hardware present; errors name ``option``, the one the user gave."""
    spec = (device or "auto").strip().lower()
    if spec == "auto" and option == "--target-device" and torch.cuda.is_available() and torch.cuda.device_count() >= 3:
        spec = ",".join(plan_target("auto", gpus=torch.cuda.device_count()).devices)  # TP over all GPUs but the last
    if spec == "auto":
        spec = "cuda:0" if torch.cuda.is_available() else "cpu"
    several = "," in spec or spec.startswith("pipeline:")  # checked whole against the machine, rank by rank
    form = None if several else parse_form(spec, device, option)
    if form is None or form.kind != "single":  # cuda:0-3 is one entry and several ranks
        return _several(spec, device, dtype, option)
    first = _present(form.devices[0], form.cores[0] if form.cores else None, spec, option)
    return Placement(first, _dtype(dtype, first), form.cores[0] if form.cores else None)


def _present(where: str, cores: tuple[int, ...] | None, spec: str, option: str) -> torch.device:
    """One device of the grammar (``cpu``, ``cuda:N``, ``mps``), checked against this machine."""
    if where == "cpu":
        avail = cores_present()
        if cores is not None and any(c not in avail for c in cores):
            raise DeviceError(f"{option} {spec}: this machine has CPU cores {avail[0]}-{avail[-1]} only")
        return torch.device("cpu")
    if where == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise DeviceError(f"{option} mps: Apple Metal is not available")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"{option} {spec}: no CUDA GPU is available "
            f"(torch {torch.__version__}{'' if torch.version.cuda else ', a CPU-only build'}); use {option} cpu"
        )
    idx = int(where.split(":")[1])
    if idx >= torch.cuda.device_count():
        raise DeviceError(f"{option} {spec}: no such device, this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device("cuda", idx)


def _several(spec: str, given: str, dtype: str, option: str) -> Placement:
    """A device list or range (see :mod:`placement`): tensor parallelism (one rank per GPU or per
    listed CPU core set), or with ``pipeline:`` transformers' device_map over the GPUs."""
    plan = parse_devices(spec, given, option)
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
