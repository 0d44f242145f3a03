"""Where the target runs, from ``--target-device`` / ``--draft-device``: checked before anything loads.

    auto                        the GPUs if any: 3 or more -> tensor parallelism over all but the last
                                (over fewer, if that splits the model's kv heads evenly), the draft on
                                the next; 2 -> target cuda:0, draft cuda:1; 1 -> both on cuda:0;
                                none -> the CPU.  The plan's ``note`` says what it chose.
    cpu | cpu:N | cpu:N-M       one process (cpu:N-M: pinned to those cores)
    cuda | cuda:N | mps         one device
    cuda:0-3 | cuda:0,cuda:1    tensor parallelism, one rank per GPU (NCCL)
    cpu:0,cpu:1                 tensor parallelism, one rank per listed core (or core range) over gloo:
                                the multi-GPU code path on a CPU, for testing, not for speed
    pipeline:cuda:0,cuda:1      transformers' device_map: the layers spread over the GPUs, one GPU at
                                work at a time; only for architectures the compact core does not cover

``--draft-device auto`` is the first GPU the target does not use (the last target GPU, shared,
when it uses them all); on CPU it stays ``auto`` for the SSD plan, which gives the draft the
cores the target leaves.  No torch import unless the GPU count is needed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import DeviceError

CPU_TP_NOTE = ("tensor parallelism on CPU (gloo, one rank per core) is for testing the multi-GPU code path, not for "
               "speed: it is slower than one process")
_ENTRY = re.compile(r"(cpu|cuda)(?::(\d+)(?:-(\d+))?)?|mps")


@dataclass(frozen=True)
class TargetPlan:
    kind: str  # "single" | "tp" | "pipeline"
    devices: tuple[str, ...]  # tp: one per rank; pipeline: the GPUs; single: the device
    cores: tuple[tuple[int, ...], ...] | None = None  # CPU: per rank (tp) or the one pinned set (single)
    draft_device: str = "auto"
    note: str = ""  # one line for the user: what auto chose, that CPU TP is for testing, a shared GPU

    @property
    def world(self) -> int:
        return len(self.devices) if self.kind == "tp" else 1

    @property
    def backend(self) -> str | None:
        return None if self.kind != "tp" else "nccl" if self.devices[0].startswith("cuda") else "gloo"

    @property
    def label(self) -> str:
        if self.kind == "single":
            return self.devices[0] + (f" (cores {_cores(self.cores[0])})" if self.cores else "")
        if self.kind == "pipeline":
            return f"pipeline over {','.join(self.devices)}"
        ranks = [f"cpu core{'s' if len(c) > 1 else ''} {_cores(c)}" for c in self.cores] if self.cores else list(self.devices)
        return f"tensor-parallel over {self.world} ranks ({', '.join(ranks)})"


def _cores(c: tuple[int, ...]) -> str:
    return f"{c[0]}-{c[-1]}" if len(c) > 1 and c == tuple(range(c[0], c[-1] + 1)) else ",".join(map(str, c))


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cores_present() -> list[int]:
    """The CPU cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def plan_target(target_device: str = "auto", draft_device: str = "auto", kv_heads: int | None = None,
                gpus: int | None = None, cpu_cores: list[int] | None = None) -> TargetPlan:
    """Parse and check both options against this machine (``gpus``/``cpu_cores`` default to what is
    present).  ``kv_heads``, when known, lets ``auto`` pick a rank count that splits them evenly.
    A DeviceError (one line, naming the option) for anything that cannot work."""
    spec = (target_device or "auto").strip().lower()
    n_gpus = _gpu_count() if gpus is None and ("cuda" in spec or spec == "auto" or "cuda" in (draft_device or "")) else (gpus or 0)
    avail = cpu_cores if cpu_cores is not None else cores_present()
    if spec == "auto":
        plan = _auto(n_gpus, kv_heads)
    else:
        plan = _parse(spec, target_device, n_gpus, avail)
    return _with_draft(plan, draft_device, n_gpus, avail, auto=spec == "auto")


def parse_devices(spec: str, given: str | None = None, option: str = "--target-device", gpus: int | None = None,
                  cpu_cores: list[int] | None = None) -> TargetPlan:
    """One option's device list (not ``auto``), checked against this machine; no draft resolved."""
    spec = spec.strip().lower()
    n = (_gpu_count() if "cuda" in spec else 0) if gpus is None else gpus
    return _parse(spec, given or spec, n, cpu_cores if cpu_cores is not None else cores_present(), option)


def _auto(gpus: int, kv_heads: int | None) -> TargetPlan:
    if gpus >= 3:
        n = gpus - 1
        if kv_heads:  # the most ranks (of gpus - 1) that split the kv heads evenly
            n = max(d for d in range(1, gpus) if kv_heads % d == 0)
        devs = tuple(f"cuda:{i}" for i in range(n))
        kind = "tp" if n > 1 else "single"
        what = f"tensor parallelism over cuda:0-{n - 1}" if n > 1 else "the target on cuda:0"
        return TargetPlan(kind, devs, note=f"--target-device auto: {what}")
    if gpus:
        what = "the target on cuda:0" if gpus == 2 else "cuda:0 (the only GPU)"
        return TargetPlan("single", ("cuda:0",), note=f"--target-device auto: {what}")
    return TargetPlan("single", ("cpu",), note="--target-device auto: the CPU (no CUDA GPU)")


def parse_form(spec: str, given: str | None = None, option: str = "--target-device") -> TargetPlan:
    """One option's value (not ``auto``) read by the grammar above, without this machine: the devices and
    cores it names, for the caller to check against the hardware."""
    spec = spec.strip().lower()
    return _parse(spec, given or spec, None, None, option)


def check_forms(target_device: str | None, draft_device: str | None = None) -> None:
    """Both options' spelling, without this machine (no torch import, no GPU count, no core list):
    what the command line checks before anything loads or the app opens.  A DeviceError in one
    line; the hardware itself is checked at load (``parse_devices``, ``models.parse_placement``)."""
    for value, option in ((target_device, "--target-device"), (draft_device, "--draft-device")):
        spec = (value or "auto").strip().lower()
        if spec == "auto":
            continue
        plan = parse_form(spec, value, option)
        if plan.kind != "single" and option == "--draft-device":
            raise DeviceError(f"--draft-device {value}: the draft runs on one device (list several for the target only)")


def _parse(spec: str, given: str, gpus: int | None, avail: list[int] | None, option: str = "--target-device") -> TargetPlan:
    """``gpus`` / ``avail`` None: check the form only."""
    pipeline = spec.startswith("pipeline:")
    body = spec.removeprefix("pipeline:")
    entries = [e.strip() for e in body.split(",")]
    if not body or any(not e for e in entries):
        raise DeviceError(f"{option}: invalid device '{given}'")
    gpu_ids: list[int] = []
    cpu: list[tuple[int, ...] | None] = []
    for e in entries:
        m = _ENTRY.fullmatch(e)
        if m is None:
            raise DeviceError(f"{option}: unknown device '{e}' (use cpu, cpu:N, cpu:0,cpu:1, cuda:N, cuda:0-3, cuda:0,cuda:1, "
                              "pipeline:cuda:0,cuda:1 or mps)")
        if e == "mps":
            if len(entries) > 1 or pipeline:
                raise DeviceError(f"{option}: mps is one device; it cannot be listed with others")
            return TargetPlan("single", ("mps",))
        lo = int(m.group(2)) if m.group(2) is not None else None
        hi = int(m.group(3)) if m.group(3) is not None else lo
        if lo is not None and hi is not None and hi < lo:
            raise DeviceError(f"{option} {e}: the range runs backwards")
        span = tuple(range(lo, hi + 1)) if lo is not None and hi is not None else None
        if m.group(1) == "cuda":
            gpu_ids += list(span) if span is not None else [0]
        else:
            cpu.append(span)
    if gpu_ids and cpu:
        raise DeviceError(f"{option}: a model runs on CPU cores or on GPUs, not on both")
    if gpu_ids:
        return _gpu_plan(gpu_ids, pipeline, given, gpus, option)
    if pipeline:
        raise DeviceError(f"{option}: pipeline: spreads a model over GPUs only")
    flat = [c for span in cpu for c in (span or ())]
    missing = sorted({c for c in flat if c not in avail}) if avail is not None else []
    if missing:
        raise DeviceError(f"{option} {given}: this machine has CPU cores {_cores(tuple(avail))} only (no core {missing[0]})")
    if len(cpu) == 1:
        return TargetPlan("single", ("cpu",), (cpu[0],) if cpu[0] else None)
    if any(span is None for span in cpu):
        raise DeviceError(f"{option} {given}: name each rank's core (cpu:0,cpu:1)")
    if len(set(flat)) != len(flat):
        raise DeviceError(f"{option} {given}: a core is listed for two ranks")
    return TargetPlan("tp", ("cpu",) * len(cpu), tuple(s for s in cpu if s), note=CPU_TP_NOTE)


def _gpu_plan(ids: list[int], pipeline: bool, given: str, gpus: int | None, option: str) -> TargetPlan:
    if gpus == 0:
        raise DeviceError(f"{option} {given}: no CUDA GPU is available; use {option} cpu (or cpu:0,cpu:1 to try tensor parallelism)")
    if len(set(ids)) != len(ids):
        raise DeviceError(f"{option} {given}: a GPU is listed twice")
    bad = [i for i in ids if i >= gpus] if gpus is not None else []
    if bad:
        raise DeviceError(f"{option} {given}: no cuda:{bad[0]}, this machine has {gpus} CUDA GPU(s) (cuda:0-{gpus - 1})")
    devs = tuple(f"cuda:{i}" for i in ids)
    if pipeline:
        if len(devs) < 2:
            raise DeviceError(f"{option} {given}: pipeline: needs at least two GPUs")
        return TargetPlan("pipeline", devs, note="pipeline (device_map): one GPU works at a time; tensor parallelism "
                                                 "(cuda:0,cuda:1 without pipeline:) runs them all at once")
    return TargetPlan("tp" if len(devs) > 1 else "single", devs)


def _with_draft(plan: TargetPlan, draft_device: str, gpus: int, avail: list[int], auto: bool = False) -> TargetPlan:
    spec = (draft_device or "auto").strip().lower()
    notes = [plan.note] if plan.note else []
    on_gpu = plan.devices[0].startswith("cuda")
    if spec != "auto":
        d = _parse(spec, draft_device, gpus, avail, "--draft-device")
        if d.kind != "single":
            raise DeviceError(f"--draft-device {draft_device}: the draft runs on one device (list several for the target only)")
        draft = d.devices[0] if not d.cores else spec
        if on_gpu and draft in plan.devices:
            notes.append(f"the draft shares {draft} with the target")
    elif on_gpu:
        used = {int(d.split(":")[1]) for d in plan.devices}
        free = [g for g in range(gpus) if g not in used]
        draft = f"cuda:{free[0]}" if free else plan.devices[-1]
        if not free and gpus > 1:
            notes.append(f"every GPU holds the target, so the draft shares {draft} with it")
        elif auto and free:
            notes[0] += f", the draft on {draft}"
    else:
        draft = "auto"
    return TargetPlan(plan.kind, plan.devices, plan.cores, draft, "; ".join(notes))

