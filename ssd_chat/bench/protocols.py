"""Where each mode runs under each protocol (see :mod:`ssd_chat.bench`), and the ``--preset gpu`` defaults."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from . import BenchError

PROTOCOLS = ("paper", "equal")
# --preset gpu: (target, draft) alias pairs tried in order; the first whose models are in the local HF cache wins
GPU_PAIRS = (("llama-3-8b", "llama-3-1b"), ("qwen3-8b", "qwen3-0.6b"), ("smollm2-1.7b", "smollm2-135m"),
             ("qwen3-1.7b", "qwen3-0.6b"), ("llama-3-3b", "llama-3-1b"), ("smollm2-360m", "smollm2-135m"))


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one mode runs under one protocol.  ``cores``/``threads``: the app process (CPU only)."""

    protocol: str
    mode: str
    target_device: str
    draft_device: str
    cores: tuple[int, ...] | None
    threads: int | None
    note: str = ""

    @property
    def slot(self) -> tuple:
        """Plans with the same slot are the same configuration (run once, reported under both protocols)."""
        return (self.mode, self.target_device, self.draft_device, self.cores, self.threads)

    @property
    def slot_id(self) -> str:
        return "|".join(map(str, self.slot))

    def describe(self) -> str:
        if self.cores is not None:
            where = f"target on core{'s' if len(self.cores) > 1 else ''} {cores_text(self.cores)} ({self.threads} thread{'s' if self.threads != 1 else ''})"
        else:
            where = f"target on {self.target_device}"
        if self.mode == "sd":
            where += ", draft in-process" if self.cores is not None else f", draft on {self.draft_device}"
        elif self.mode == "ssd":
            where += f", speculator on {self.draft_device}"
        return where


def cores_text(cs: tuple[int, ...]) -> str:
    return f"{cs[0]}-{cs[-1]}" if len(cs) > 2 and cs == tuple(range(cs[0], cs[-1] + 1)) else ",".join(map(str, cs))


@dataclass(frozen=True, slots=True)
class Hardware:
    cpu_cores: tuple[int, ...]
    num_gpus: int

    @classmethod
    def detect(cls) -> "Hardware":
        import torch

        cores = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else tuple(range(os.cpu_count() or 1))
        return cls(cores, torch.cuda.device_count() if torch.cuda.is_available() else 0)


def _cpu_cores_of(device: str) -> tuple[int, ...] | None:
    d = device.strip().lower()
    if d.startswith("cpu:"):
        lo, _, hi = d[4:].partition("-")
        return tuple(range(int(lo), int(hi or lo) + 1))
    return None


def _cpu_ranks(device: str, avail: tuple[int, ...]) -> tuple[int, ...] | None:
    """The cores of a tensor-parallel CPU target (``cpu:0,cpu:1``), None for one process."""
    if "," not in device:
        return None
    from ..engine import DeviceError, parse_devices

    try:
        plan = parse_devices(device, cpu_cores=list(avail))
    except DeviceError as e:
        raise BenchError(str(e)) from e
    return tuple(c for rank in plan.cores or () for c in rank) or None


def make_plans(protocols: tuple[str, ...], modes: tuple[str, ...], target_device: str, draft_device: str,
               hw: Hardware) -> tuple[list[Plan], list[str]]:
    """Plans for every (protocol, mode) and notes for the report."""
    notes: list[str] = []
    td, dd = (target_device or "auto").strip().lower(), (draft_device or "auto").strip().lower()
    on_gpu = td.startswith("cuda") or (td == "auto" and hw.num_gpus > 0)
    plans: list[Plan] = []
    if not on_gpu:
        if td not in ("auto", "cpu") and not td.startswith("cpu"):
            raise BenchError(f"--target-device {target_device}: the benchmark runs on cpu[:N] or cuda[:N]")
        avail = hw.cpu_cores
        ranks = _cpu_ranks(td, avail)  # tensor-parallel ranks: every mode runs on them, pinned to their cores
        t_cores = ranks or _cpu_cores_of(td) or (avail[:-1] if len(avail) >= 2 else avail)
        d_cores = _cpu_cores_of(dd) or (tuple(c for c in avail if c not in t_cores)[-1:] or t_cores[-1:])
        for c in (*t_cores, *d_cores):
            if c not in avail:
                raise BenchError(f"CPU core {c} is not available to this process (available: {cores_text(avail)})")
        if set(t_cores) & set(d_cores):
            notes.append(f"only {len(avail)} CPU core(s): the SSD speculator shares core(s) {cores_text(d_cores)} with the target, so SSD cannot overlap drafting with verification")
        all_cores = tuple(sorted(set(t_cores) | set(d_cores)))
        spec_dev = f"cpu:{d_cores[0]}" if len(d_cores) == 1 else f"cpu:{d_cores[0]}-{d_cores[-1]}"
        where = td if ranks else "cpu"
        for proto in protocols:
            for mode in modes:  # equal: AR and SD get the speculator's cores too (not over tensor-parallel ranks)
                cores = all_cores if mode != "ssd" and proto != "paper" and not ranks else t_cores
                plans.append(Plan(proto, mode, where, spec_dev if mode == "ssd" else "cpu", cores, len(cores)))
        return plans, notes
    if hw.num_gpus == 0:
        raise BenchError("a CUDA device was requested but no NVIDIA GPU is visible to torch (torch.cuda.is_available() is False)")
    t_list = [d.strip() for d in td.split(",")] if td != "auto" else ["cuda:0"]
    t_list = [d if ":" in d else "cuda:0" for d in t_list]
    used = {int(d.split(":")[1]) for d in t_list}
    if dd != "auto":
        d_dev = dd if ":" in dd else "cuda:0"
    else:
        free = [i for i in range(hw.num_gpus) if i not in used]
        d_dev = f"cuda:{free[-1]}" if free else t_list[0]
    if d_dev in t_list:
        notes.append(f"{hw.num_gpus} GPU(s) and none free for the draft: the SSD speculator shares {d_dev} with the target, "
                     "so its drafting competes with verification (the paper gives the draft its own GPU)")
    extra = t_list + ([d_dev] if d_dev not in t_list else [])  # equal: the draft's GPU too, as a device_map pipeline
    equal_target = ("pipeline:" if len(extra) > 1 else "") + ",".join(extra)
    for proto in protocols:
        for mode in modes:
            target = equal_target if mode != "ssd" and proto != "paper" else ",".join(t_list)
            plans.append(Plan(proto, mode, target, d_dev if mode == "ssd" else t_list[0], None, None))
    return plans, notes


def gpu_preset(values: dict[str, Any], given: set[str], hw: Hardware) -> tuple[dict[str, Any], list[str]]:
    """Defaults for ``--preset gpu``: a (target, draft) pair from the local HF cache, bf16, the draft on its own GPU."""
    notes: list[str] = []
    if hw.num_gpus == 0:
        raise BenchError("--preset gpu needs an NVIDIA GPU, and torch sees none (torch.cuda.is_available() is False); "
                         "run the CPU benchmark without --preset")
    out = dict(values)
    if "target" not in given:
        from ..engine import local_status

        local = {r["alias"] for r in local_status() if r["local"]}
        pair = next(((t, d) for t, d in GPU_PAIRS if t in local and d in local), None)
        if pair is None:
            raise BenchError("--preset gpu found no (target, draft) pair in the local Hugging Face cache; tried "
                             + ", ".join(f"{t} + {d}" for t, d in GPU_PAIRS) + ". Download one (e.g. `hf download HuggingFaceTB/SmolLM2-1.7B-Instruct` "
                             "and HuggingFaceTB/SmolLM2-135M-Instruct) or pass --target and --draft")
        out["target"], out["draft"] = pair
    if "dtype" not in given:
        out["dtype"] = "bfloat16"
    if hw.num_gpus == 1:
        notes.append("one GPU: the SSD speculator shares it with the target; the paper's protocol gives the draft its own GPU")
    elif "target_device" not in given:
        # the draft gets the last GPU; the target shards over the others only if one GPU is not enough
        out["target_device"] = "cuda:0"
        out["draft_device"] = f"cuda:{hw.num_gpus - 1}"
    return out, notes
