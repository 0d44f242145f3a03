"""Helpers of the CPU measurement script (:mod:`lab.cpu_perf`, :mod:`lab.cpu_perf_drafts`): the
packaged model with and without its GGUF linears, pinning, CPU-time timing, forwards and greedy runs."""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

import torch


def log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def pin(cores: tuple[int, ...], threads: int) -> None:
    """Every thread of this process on ``cores``; torch (and so the GGUF kernels) on ``threads``."""
    torch.set_num_threads(threads)
    if hasattr(os, "sched_setaffinity"):
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), cores)
            except OSError:
                pass


def load_average() -> float:
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else -1.0


def timed(f: Callable[[], Any], reps: int, threads: int) -> dict[str, float]:
    """ms per call of ``f``: CPU time of this thread at one thread (fastest, median), wall otherwise."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    f()
    ts = []
    for _ in range(reps):
        t0 = clock()
        f()
        ts.append(clock() - t0)
    return {"min_ms": round(min(ts) * 1e3, 2), "median_ms": round(statistics.median(ts) * 1e3, 2),
            "clock": "thread CPU" if threads == 1 else "wall"}


# --- the models -----------------------------------------------------------------------------------


class Models:
    """The packaged model as the app loads it (float32, fastlinear) and its GGUF linears."""

    def __init__(self) -> None:
        from ssd_chat.engine.load import gguf_weights as fast_weights
        from ssd_chat.engine.cpu import quant
        from ssd_chat.engine.load import models

        t0 = time.perf_counter()
        self.lm = models.load_model(models.PACKAGED, models.parse_placement("cpu", "float32"))
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.gguf = fast_weights.gguf_target(self.lm)
        self.gguf_s = time.perf_counter() - t0
        self.path = models.packaged_gguf()
        self._old: dict[str, Any] | None = None
        self.quant = quant

    @property
    def model(self) -> torch.nn.Module:
        return self.lm.model

    def swapped(self, on: bool) -> None:
        """GGUF linears in the model (on) or its float32 ones (off)."""
        if on and self._old is None:
            self._old = self.quant.swap_modules(self.model, self.gguf)
        elif not on and self._old is not None:
            self.quant.swap_modules(self.model, self._old)
            self._old = None


def forward(core: Any, rows: int, tree: bool) -> Callable[[], None]:
    def run() -> None:
        L = core.kv.length
        if tree:  # an SSD tree step at depth 0: each row sees the prefix and itself
            core.tree([(17 * b + 5) % 1000 + 10 for b in range(rows)], [L] * rows, [L + b for b in range(rows)], [[] for _ in range(rows)])
        else:
            core.append(list(range(10, 10 + rows)))
            core.kv.truncate(L)
    return run


def greedy(core: Any, prompt: list[int], n: int, clock: Callable[[], float] = time.thread_time) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """n greedy tokens through ``core`` (from a reset): tokens, logits of each step, seconds of each one-token step."""
    core.reset()
    logits = [core.append(prompt, logits="last").logits[0]]
    toks: list[int] = []
    times: list[float] = []
    for _ in range(n):
        toks.append(int(logits[-1].argmax()))
        t0 = clock()
        logits.append(core.append([toks[-1]], logits="last").logits[0])
        times.append(clock() - t0)
    return toks, logits, times
