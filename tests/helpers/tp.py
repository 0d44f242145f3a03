"""Shared by the tensor-parallel tests: decoding loops written against the Core API (so the same
loop runs on a single-rank Core and on a TPCore), and the processes a test left behind."""

from __future__ import annotations

import os

import torch

from ssd_chat.engine.events import Done
from ssd_chat.engine.tp.core import TPCore
from ssd_chat.engine.sampling.sampling import logits_to_probs, make_generator, sample, sample_next, verify


def greedy(core, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``prompt`` on a Core or TPCore (the cache is left at the prompt)."""
    core.reset()
    lg = core.append(prompt, logits="last").logits[-1]
    out: list[int] = []
    while len(out) < n:
        out.append(int(lg.argmax()))
        lg = core.append(out[-1:], logits="last").logits[-1]
    core.kv.truncate(len(prompt))
    return out


def rank_cores(n: int = 2) -> list[tuple[int, ...]] | None:
    """One core per rank when this process may use ``n`` cores, else no pinning."""
    avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return [(c,) for c in avail[:n]] if len(avail) >= n else None


def save(model: torch.nn.Module, folder) -> str:
    model.save_pretrained(str(folder))
    return str(folder)


def start(folder: str, world: int = 2, **kw) -> TPCore:
    return TPCore(folder, ["cpu"] * world, "tiny", dtype=torch.float64, cores=rank_cores(world), **kw)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def ar_stream(core):
    """An AR decoder over a core, for tests/distribution.py (``max_new_tokens`` tokens, no EOS)."""

    def stream(prompt, params):
        gen = make_generator(params.seed)
        core.reset()
        lg = core.append(prompt, logits="last").logits[-1]
        out: list[int] = []
        while True:
            out.append(sample_next(lg, params.temperature, params.top_k, params.top_p, gen))
            if len(out) == params.max_new_tokens:
                break
            lg = core.append(out[-1:], logits="last").logits[-1]
        yield Done("length", "", tuple(out), None)

    return stream


def sd_stream(target, draft, k: int):
    """Speculative decoding over two cores: the draft proposes k tokens from q, the target verifies
    them in one (k+1)-row append with sampling.verify, both caches roll back by length."""

    def stream(prompt, params):
        gen = make_generator(params.seed)
        probs = lambda lg: logits_to_probs(lg.double(), params.temperature, params.top_k, params.top_p)  # noqa: E731
        target.reset(), draft.reset()
        ctx, last = list(prompt[:-1]), prompt[-1]
        if ctx:
            target.append(ctx, logits="none"), draft.append(ctx, logits="none")
        out: list[int] = []
        while len(out) < params.max_new_tokens:
            base = len(ctx)
            q_rows, ids = [], []
            g = draft.append([last], logits="last").logits[-1]
            for i in range(k):
                q = probs(g[None])[0]
                ids.append(int(sample(q, gen)))
                q_rows.append(q)
                if i < k - 1:
                    g = draft.append(ids[-1:], logits="last").logits[-1]
            p = probs(target.append([last] + ids).logits)
            n, bonus = verify(torch.tensor(ids), torch.stack(q_rows), p, gen)
            ctx += [last] + ids[:n]
            target.kv.truncate(len(ctx))
            if n == k:
                draft.append(ids[-1:], logits="none")
            draft.kv.truncate(len(ctx))
            assert target.kv.length == draft.kv.length == base + 1 + n
            out += ids[:n] + [bonus]
            last = bonus
        yield Done("length", "", tuple(out[: params.max_new_tokens]), None)

    return stream


def alive(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that still run (a zombie does not: it has exited and waits to be reaped)."""
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out
