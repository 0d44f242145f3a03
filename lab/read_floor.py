"""The memory floor of one forward on one core (docs/performance-cpu.md, "The floor").

    python -m lab.read_floor [--mb 512] [--repeats 7] [--no-model]

A STREAM-like read: a float32 torch sum over ``--mb`` MiB (far above any cache) on one thread,
fastest of ``--repeats``, timed by this thread's CPU time (on a busy machine wall time also counts
the waits for other processes).  Then the bytes one forward of the packaged model's target reads
(every GGUF linear's blocks: quants, scales, offsets; the head once, although it is tied to the
embedding) and the floor, bytes / bandwidth: no 1-row step can be faster than that.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def read_bandwidth(mb: int = 512, repeats: int = 7) -> float:
    """GB/s one thread reads: a torch sum over ``mb`` MiB of float32, best of ``repeats``, by CPU time."""
    torch.set_num_threads(1)
    a = torch.ones(mb << 18)
    a.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        a.sum()
        best = min(best, time.thread_time() - t)
    return a.numel() * 4 / best / 1e9


def forward_bytes() -> tuple[int, int]:
    """(bytes of all the packaged target's GGUF linears, bytes of its output head)."""
    from ssd_chat.engine.cpu.quant import GGUFLinear
    from ssd_chat.engine.config import EngineConfig
    from ssd_chat.engine.engine import Engine

    e = Engine.load(EngineConfig(mode="ar", compile="off"))
    mods = [m for m in e.target.model.modules() if isinstance(m, GGUFLinear)]
    head = max(mods, key=lambda m: m.out_features)
    return sum(m.nbytes for m in mods), head.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m lab.read_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-model", action="store_true", help="only the bandwidth")
    a = ap.parse_args()
    bw = read_bandwidth(a.mb, a.repeats)
    out: dict[str, float] = {"read_GBps_1core": round(bw, 2)}
    if not a.no_model:
        total, head = forward_bytes()
        out |= {"forward_MB": round(total / 1e6, 1), "head_MB": round(head / 1e6, 1),
                "floor_ms": round(total / bw / 1e6, 2), "head_floor_ms": round(head / bw / 1e6, 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
