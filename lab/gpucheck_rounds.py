"""Greedy SSD rounds over the compact core, timed: how long the verifier waits for its drafts.

A measuring rig for the GPU check (``lab.gpucheck``), not a decoder: the tokens come
from random-weight models, so which rounds hit is decided by an *oracle*, the reference
draft model run uncompiled and untimed.  With the draft identical to the oracle every
round is a hit (up to rounding); with a perturbed draft, rounds miss as often as the two
disagree.  Each round really runs, concurrently:

* the verifier (this thread, its own CUDA stream): the target's forward over
  ``[bonus, d_1..d_k]`` (its tokens are the rig's, its cost is the real one);
* the speculator (a worker thread with its own stream, which also compiled its graphs:
  CUDA graph trees belong to the thread that recorded them): the glue forward over the
  same k+1 tokens, the top-F candidates per acceptance length, and the B-branch tree,
  k single calls deep with ancestors masks.

The wait is what the verifier would spend between its verify and the next round's drafts:
on a hit, how much longer the tree took than the verify; on a miss, that plus the neural
fallback (k draft steps).  The channel round trip is measured separately and added by the
caller.  The glue is always k+1 rows here (the engine adopts a hit branch's KV and glues one
row), so hit waits are, if anything, pessimistic.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class RoundStats:
    rounds: int = 0
    hits: int = 0
    accepted: list[int] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    build_s: list[float] = field(default_factory=list)
    wait_hit_s: list[float] = field(default_factory=list)
    wait_miss_s: list[float] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def mean_ms(xs: list[float]) -> float | None:
            return round(1e3 * sum(xs) / len(xs), 3) if xs else None
        return {"rounds": self.rounds, "hit_rate": round(self.hits / max(1, self.rounds), 3),
                "mean_accepted": round(sum(self.accepted) / max(1, len(self.accepted)), 2),
                "verify_ms": mean_ms(self.verify_s), "build_ms": mean_ms(self.build_s),
                "wait_hit_ms": mean_ms(self.wait_hit_s), "wait_miss_ms": mean_ms(self.wait_miss_s)}


class Worker:
    """One thread that runs every job for the draft's core (and keeps its CUDA graphs its own)."""

    def __init__(self, device: torch.device) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.thread = threading.Thread(target=self._loop, name="speculator-rig", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job, done = self.jobs.get()
            if job is None:
                return
            try:
                with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.stream is not None else _null()):
                    done.put((True, job()))
                    if self.stream is not None:
                        self.stream.synchronize()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                done.put((False, e))

    def submit(self, job: Callable[[], Any]) -> "queue.Queue":
        done: queue.Queue = queue.Queue()
        self.jobs.put((job, done))
        return done

    @staticmethod
    def result(done: "queue.Queue") -> Any:
        ok, val = done.get()
        if not ok:
            raise val
        return val

    def run(self, job: Callable[[], Any]) -> Any:
        return self.result(self.submit(job))

    def close(self) -> None:
        self.jobs.put((None, None))
        self.thread.join(timeout=10)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_tree(draft: Any, L: int, bonus: int, drafts: list[int], k: int, fan: int) -> dict[tuple[int, int], tuple[int, ...]]:
    """Glue over [bonus, d_1..d_k] after L committed tokens, then k tree depths over the B = fan*(k+1)
    branches (j, c): c among the top ``fan`` of g_j, never d_{j+1}.  Returns {(j, c): (e_1..e_k)}."""
    draft.kv.truncate(L)
    g = draft.append([bonus, *drafts]).logits.float()  # [k+1, V]
    for j in range(k):
        g[j, drafts[j]] = float("-inf")
    branches = [(j, int(c)) for j in range(k + 1) for c in torch.topk(g[j], fan).indices.tolist()]
    B, base = len(branches), draft.kv.length
    x = [c for _, c in branches]
    own: list[list[int]] = [[] for _ in range(B)]
    toks: list[list[int]] = [[] for _ in range(B)]
    for d in range(k):
        slots = [base + d * B + b for b in range(B)]
        anc = [list(range(L, L + j + 1)) + own[b] for b, (j, _) in enumerate(branches)]
        out = draft.tree(x, [L + 1 + j + d for j, _ in branches], slots, anc, prefix=L)
        x = out.logits.argmax(-1).tolist()
        for b in range(B):
            own[b].append(slots[b])
            toks[b].append(x[b])
    return {key: tuple(t) for key, t in zip(branches, toks)}


def fallback(draft: Any, keep: int, bonus: int, k: int) -> list[int]:
    """The neural fallback: drop what the glue drafted past ``keep``, then k greedy draft steps."""
    draft.kv.truncate(keep)
    out: list[int] = []
    tok = bonus
    for _ in range(k):
        tok = int(draft.append([tok], logits="last").logits[-1].argmax())
        out.append(tok)
    return out


def run_rounds(target: Any, draft: Any, oracle: Any, worker: Worker, prompt: list[int], k: int, fan: int, rounds: int,
               budget_s: float) -> RoundStats:
    """``rounds`` greedy SSD rounds from ``prompt`` (see the module docstring).  All three cores start empty."""
    dev = target.device
    stats = RoundStats()
    ctx, bonus = list(prompt[:-1]), prompt[-1]
    target.reset(), oracle.reset()
    target.append(ctx, logits="none")
    oracle.append(ctx, logits="none")
    worker.run(lambda: (draft.reset(), draft.append(ctx, logits="none")))
    drafts = worker.run(lambda: fallback(draft, len(ctx), bonus, k))
    t_end = time.perf_counter() + budget_s
    verify_stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    while stats.rounds < rounds and time.perf_counter() < t_end:
        L, T0 = len(ctx), target.kv.length
        _sync(dev)
        t0 = time.perf_counter()
        build: dict[str, float] = {}

        def spec_job(L: int = L, bonus: int = bonus, drafts: list[int] = drafts) -> dict:
            cache = build_tree(draft, L, bonus, drafts, k, fan)
            if worker.stream is not None:
                worker.stream.synchronize()
            build["end"] = time.perf_counter()
            return cache

        pending = worker.submit(spec_job)
        with torch.inference_mode(), (torch.cuda.stream(verify_stream) if verify_stream is not None else _null()):
            target.append([bonus, *drafts], logits="all")
            if verify_stream is not None:
                verify_stream.synchronize()
        t_verify = time.perf_counter()
        target.kv.truncate(T0)  # the rig's target keeps a fixed context: only its cost matters
        cache = worker.result(pending)
        # the outcome, by the oracle (untimed)
        with torch.inference_mode():
            a = oracle.append([bonus, *drafts]).logits.argmax(-1).tolist()
        n = 0
        while n < k and drafts[n] == a[n]:
            n += 1
        new_bonus = a[n]
        oracle.kv.truncate(L + 1 + n)
        entry = cache.get((n, new_bonus))
        stats.rounds += 1
        stats.accepted.append(n)
        stats.verify_s.append(t_verify - t0)
        stats.build_s.append(build["end"] - t0)
        ready = max(t_verify, build["end"])
        if entry is not None:
            stats.hits += 1
            stats.wait_hit_s.append(ready - t_verify)
            nxt = list(entry)
        else:
            f0 = time.perf_counter()
            nxt = worker.run(lambda: fallback(draft, L + 1 + n, new_bonus, k))
            stats.wait_miss_s.append(ready - t_verify + time.perf_counter() - f0)
        ctx += [bonus, *drafts[:n]]
        bonus, drafts = new_bonus, nxt
    return stats
