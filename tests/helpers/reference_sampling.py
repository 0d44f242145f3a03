"""The sampling distribution written out plainly over the whole vocabulary, independently of the
engine's code: what the fast sampler (``engine/sampling/support.py``) and the distribution tests are
checked against.

Order as in transformers: penalties, temperature, top-k (every logit equal to the k-th largest
stays), top-p (tokens by descending logit, equal ones by ascending id; a token goes once the mass
before it reaches top-p; the first always stays).  The division by the temperature is the engine's
float32 one; the rest is float64.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch


def penalized(logits: torch.Tensor, prompt: Sequence[int], reply: Sequence[int], repetition: float = 1.0,
              frequency: float = 0.0, presence: float = 0.0) -> torch.Tensor:
    """vLLM's formulas token by token: repetition over each distinct id of prompt + reply (CTRL),
    then frequency and presence over the reply (OpenAI).  float32, as the engine computes them."""
    out = logits.float().clone()
    for tok in set(prompt) | set(reply):
        if repetition != 1.0:
            x = out[tok]
            out[tok] = x / repetition if x > 0 else x * repetition
    for tok in set(reply):
        if frequency != 0.0:
            out[tok] = out[tok] - frequency * torch.tensor(float(reply.count(tok)))
        if presence != 0.0:
            out[tok] = out[tok] - presence * torch.tensor(1.0)
    return out


def probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, float]:
    """The distribution [V] (float64) of one row of penalized logits, and how close the nucleus walk came
    to top-p (a margin of float32 rounding decides nothing when it is large)."""
    if temperature == 0.0:
        x = logits.tolist()
        best = max(range(len(x)), key=lambda i: (x[i], -i))
        out = torch.zeros(len(x), dtype=torch.float64)
        out[best] = 1.0
        return out, math.inf
    x = (logits.float() / temperature).tolist()
    keep = list(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        keep = [i for i in keep if x[i] >= kth]
    margin = math.inf
    if top_p < 1.0:
        order = sorted(keep, key=lambda i: (-x[i], i))
        w = _weights(x, order)
        z = sum(w.values())
        keep, mass = [], 0.0
        for i in order:
            margin = min(margin, abs(mass - top_p))
            if keep and mass >= top_p:
                break
            keep.append(i)
            mass += w[i] / z
    w = _weights(x, keep)
    z = sum(w.values())
    out = torch.zeros(len(x), dtype=torch.float64)
    for i in keep:
        out[i] = w[i] / z
    return out, margin


def _weights(x: list[float], ids: list[int]) -> dict[int, float]:
    m = max(x[i] for i in ids)
    return {i: math.exp(x[i] - m) for i in ids}


def agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """An engine distribution equals the reference one: the same support, the same mass to float32's precision."""
    return torch.equal(got > 0, want > 0) and torch.allclose(got.double(), want, atol=1e-6, rtol=1e-4)


def cases(n: int, seed: int, make: Callable[[random.Random], dict],
          reference: Callable[[dict], tuple[torch.Tensor, float]]) -> list[dict]:
    """``n`` random cases from ``make``, each with its reference distribution as ``"want"``; only those whose
    top-p boundary is more than 1e-5 away, where float32 and float64 walks cannot disagree on the nucleus."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        c = make(rng)
        c["want"], margin = reference(c)
        if margin > 1e-5:
            out.append(c)
    return out
