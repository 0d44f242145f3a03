"""The machine under the benchmark: pinning the app's threads to a plan's cores, what else is running,
its description for the report, and the two physical quantities behind the memory bound: the bytes of
the target's weights (read once per forward at batch 1) and the memory bandwidth this placement reads at."""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

from .protocols import Hardware


class Pinning:
    """Pin every thread of this process to some cores and set torch's thread count; restore on exit."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._threads0 = torch.get_num_threads()
        self._cores0 = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_setaffinity") else None
        self.enforced = self._cores0 is not None and os.path.isdir("/proc/self/task")

    def apply(self, cores: tuple[int, ...] | None, threads: int | None) -> None:
        if threads is not None:
            self._torch.set_num_threads(threads)
            from ..engine import prepare_fast_linears

            prepare_fast_linears()  # few-row choices timed for this thread count (during the warm-up)
        if cores is not None and self.enforced:
            self._set_all(cores)

    def _set_all(self, cores: tuple[int, ...]) -> None:
        # os.sched_setaffinity(0, ...) moves only the calling thread; torch's worker threads need it too
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(int(tid), cores)

    def restore(self) -> None:
        self._torch.set_num_threads(self._threads0)
        if self._cores0 is not None and self.enforced:
            self._set_all(self._cores0)


def descendants_cpu_s(exclude: frozenset[int] = frozenset()) -> float | None:
    """CPU seconds used so far by this process's descendants but ``exclude`` (the target's own
    tensor-parallel ranks) and theirs (Linux; None elsewhere)."""
    if not os.path.isdir("/proc"):
        return None
    me = os.getpid()
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        parent[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])  # utime + stime
    total = 0
    for pid in ticks:
        p = parent.get(pid)
        hops = {pid}
        while p and p != me and p in parent:
            hops.add(p)
            p = parent[p]
        if p == me and pid != me and not hops & exclude:
            total += ticks[pid]
    return total / os.sysconf("SC_CLK_TCK")


def machine_info(hw: Hardware) -> dict[str, Any]:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    gpus = [torch.cuda.get_device_name(i) for i in range(hw.num_gpus)]
    summary = f"{len(hw.cpu_cores)} × {cpu}" + (f", {len(gpus)} × {gpus[0]}" if gpus else "")
    return {"cpu": cpu, "cpu_cores": list(hw.cpu_cores), "gpus": gpus, "summary": summary,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "platform": platform.platform(), "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def busy_note(machine: dict[str, Any], hw: Hardware) -> str | None:
    """A warning when other work is running: timings on a busy CPU are noise."""
    load = (machine.get("loadavg_start") or [0.0])[0]
    if hw.num_gpus == 0 and load > 0.5 * len(hw.cpu_cores):
        return (f"the machine is busy (load average {load:.1f} on {len(hw.cpu_cores)} cores before the run): "
                "other processes compete for the cores this benchmark pins, so its timings are noisy")
    return None


def weight_bytes(model: Any) -> int:
    """Bytes a batch-1 forward streams from memory: every weight once (a shared tensor once), a GGUF
    linear as its blocks (its buffers).  An embedding table is not streamed (a forward reads one row
    per token) unless it is also the head, whose linear then counts it."""
    from torch import nn

    from ..engine import tensor_key

    seen: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            continue
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            seen.setdefault(tensor_key(t), t.numel() * t.element_size())
    return sum(seen.values())


def read_bandwidth(device: str = "cpu", repeats: int = 5) -> float:
    """Bytes per second this process reads from ``device``'s memory with the threads and cores in force:
    the best of ``repeats`` sums over a buffer far larger than any CPU cache (a decode step streams each
    weight once the same way)."""
    import torch

    dev = torch.device(device.removeprefix("pipeline:").split(",")[0])  # a sharded target: its first device
    size = (1 << 30) if dev.type == "cuda" else (256 << 20)
    x = torch.ones(size // 4, dtype=torch.float32, device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    del x
    return size / best
