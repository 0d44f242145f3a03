"""The target's log-probabilities of the tokens a reply emits, and of a prompt's tokens.

Like vLLM's default (``logprobs_mode="raw_logprobs"``), they are ``log_softmax`` of the target's raw
logits, before penalties, temperature, top-k and top-p: the model's own distribution, which is the
same whatever the sampling settings, and the same in AR, SD and SSD (exact SD and SSD score every
emitted token with the same target rows AR does).  Computed on the device and read in one
:func:`host.read` per step or round, and only when a request asks for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..sampling.host import read

Logprob = tuple[float, tuple[tuple[int, float], ...]]  # (the token's, the top alternatives (id, logprob))


def of_rows(logits: Tensor, chosen: list[int], top: int) -> list[Logprob]:
    """Row i's logprob of ``chosen[i]`` and its ``top`` most likely tokens, for the first
    ``len(chosen)`` rows of ``logits`` [R, V]: one read."""
    n = len(chosen)
    if n == 0:
        return []
    lp = torch.log_softmax(logits[:n].float(), dim=-1)
    ids = torch.tensor(chosen, dtype=torch.long, device=lp.device)
    own = lp.gather(1, ids[:, None])  # [n, 1]
    if top:
        vals, idx = lp.topk(top, dim=-1)
        flat = torch.cat([own, vals, idx.to(lp.dtype)], dim=1)  # ids < 2**24 are exact in float32
    else:
        flat = own
    rows = read(flat, "logprobs")
    return [(r[0], tuple(zip((int(i) for i in r[1 + top:]), r[1:1 + top]))) for r in rows]


def of_prompt(target: Any, ids: list[int], top: int, compile: str = "off", rows: tuple[int, ...] = (1,)) -> list[Logprob | None]:
    """Each prompt token's logprob given the tokens before it (None for the first), from one forward
    over the whole prompt that returns every position's logits.  ``compile`` and ``rows`` as the
    decoder's own runner, so that this reuses its core (between replies) and builds no other graph."""
    runner = target.forwards.runner("target", compile, rows, target.device)
    logits = runner.append(ids, logits="all").logits  # [T, V]: row t predicts ids[t + 1]
    return [None, *of_rows(logits, ids[1:], top)]
