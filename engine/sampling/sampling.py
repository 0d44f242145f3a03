"""Sampling math: small pure functions shared by AR, SD and SSD.

Randomness is always passed in (a ``torch.Generator``), so tests are exact.  Greedy decoding is
``temperature == 0``: a point mass on the argmax, for which every formula below stays valid.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) accepts ``d_i`` with probability
``min(1, p_i(d_i) / q_i(d_i))`` and samples the bonus from ``norm(max(0, p_i - q_i))`` at the first
rejection (from ``p_{k+1}`` if all k are accepted).  The output is distributed exactly as ``p`` for
*any* proposal ``q`` the drafts were really drawn from, which is what lets SSD's Saguaro sampling
reshape ``q`` freely.

On the CPU the distributions are computed on their top-k support (:mod:`support`); the dense
functions here (:func:`apply_top_k_top_p`) define them and take over where that does not apply.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .support import Support, draw, top_support


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for ``device``; ``seed=None`` draws a fresh seed."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(int(seed))
    return gen


def apply_top_k_top_p(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Mask logits outside the top-k tokens and outside the top-p nucleus with -inf: the dense
    reference that :func:`support.top_support` computes on the top-k alone.

    logits: [..., V].  Order as in transformers: top-k first, then top-p.  Top-k keeps every token
    equal to the k-th largest logit; top-p takes the tokens by descending logit, equal ones by
    ascending id, and drops a token once the mass before it reaches top_p.  The most likely token
    always survives.
    """
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # drop a token when the mass *before* it already reaches top_p
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def apply_penalties(logits: Tensor, seen: Tensor, counts: Tensor, repetition: float = 1.0,
                    frequency: float = 0.0, presence: float = 0.0) -> Tensor:
    """Penalized logits [..., V] (float32), as vLLM and transformers apply them, before temperature.

    seen:   [..., V] bool, the token occurs in the prompt or the reply so far (repetition penalty,
            CTRL: a positive logit is divided by it, a negative one multiplied);
    counts: [..., V] occurrences in the reply so far (OpenAI: ``- frequency * count - presence * [count > 0]``).
    """
    logits = logits.float()
    if repetition != 1.0:
        logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    if frequency != 0.0:
        logits = logits - frequency * counts
    if presence != 0.0:
        logits = logits - presence * (counts > 0).float()
    return logits


def _support(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Support | None:
    """On the CPU, the distributions on their top-k support (None where the dense path is needed:
    top-k off, a tie across the k-th place, or another device, where the dense path never waits for it)."""
    logits = logits.float()
    return top_support(logits, temperature, top_k, top_p) if logits.device.type == "cpu" else None


def _dense(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    return torch.softmax(apply_top_k_top_p(logits.float() / temperature, top_k, top_p), dim=-1)


def logits_to_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Next-token distributions [..., V] (float32) under the sampling settings.

    temperature 0 gives a one-hot distribution on the argmax (greedy).
    """
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    sup = _support(logits, temperature, top_k, top_p)
    return sup.dense() if sup is not None else _dense(logits, temperature, top_k, top_p)


def sample(probs: Tensor, gen: torch.Generator) -> Tensor:
    """One token id per row of ``probs`` [..., V] (returns [...] int64), by inverse CDF (:func:`support.draw`:
    a multinomial over the vocabulary costs a millisecond on a CPU)."""
    return draw(probs, gen)


def draw_draft(logits: Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator,
               saguaro_c: float = 1.0, num_top: int = 0, dense: bool = True) -> tuple[Tensor, Tensor | Support | None]:
    """Draft tokens, one per row of ``logits`` [..., V], and the q' they were drawn from: the draft's
    distribution under the sampling settings, Saguaro-reshaped over its ``num_top`` most likely tokens
    when ``saguaro_c`` < 1.  Greedy: the argmax, and None for q' (a point mass).  The one draw of SD's
    drafts, the speculator's and the in-process fallback's; the tokens stay on the device.
    ``dense=False`` returns q' as its :class:`Support` where it has one (the speculator's tree keeps
    B x k of them and sends one branch's k rows: a [B, V] row set per depth costs more than its draw)."""
    if temperature == 0.0:
        return logits.argmax(dim=-1), None
    sup = _support(logits, temperature, top_k, top_p)
    if sup is not None:
        if saguaro_c < 1.0 and num_top > 0:
            sup = sup.saguaro(saguaro_c, num_top)
        return sup.sample(gen), (sup.dense() if dense else sup)
    q = _dense(logits, temperature, top_k, top_p)
    if saguaro_c < 1.0 and num_top > 0:
        q = saguaro_reshape(q, saguaro_c, num_top)
    return sample(q, gen), q


def sample_next(logits: Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """AR step: the next token id from one row of logits [V]."""
    if temperature == 0.0:
        return int(logits.argmax(dim=-1))
    sup = _support(logits, temperature, top_k, top_p)
    return int(sup.sample(gen) if sup is not None else sample(_dense(logits, temperature, top_k, top_p), gen))


def residual(p: Tensor, q: Tensor) -> Tensor:
    """``norm(max(0, p - q))`` over the last dim; falls back to ``p`` where that is all zero."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def verify(draft_ids: Tensor, q: Tensor, p: Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Speculative sampling for one round.  Returns ``(num_accepted, bonus_id)``.

    draft_ids: [k] tokens the draft proposed, each drawn from the matching row of q.
    q:         [k, V] the draft's proposal distributions.
    p:         [k+1, V] the target's distributions at the k draft positions and one past them.
    """
    k = draft_ids.shape[0]
    if k:
        rows = torch.arange(k, device=p.device)
        p_d = p[rows, draft_ids]  # [k]
        q_d = q[rows, draft_ids]  # [k]
        u = torch.rand(k, generator=gen, device=p.device)
        # accept while u <= p/q, written without a division: u * q <= p
        ok = (u * q_d <= p_d) & (p_d > 0)
        rejected = (~ok).nonzero()
        n = int(rejected[0, 0]) if rejected.numel() else k
    else:
        n = 0
    dist = residual(p[n], q[n]) if n < k else p[k]
    bonus = int(sample(dist, gen))
    return n, bonus


def greedy_outcome(logits: Tensor, drafts: list[int]) -> tuple[int, int]:
    """:func:`verify` at temperature 0, where p and q are point masses: a draft token is accepted while
    it is the target's argmax, and the bonus is the argmax after the accepted prefix.  One argmax
    instead of a dozen small ops over [k+1, V] (at GPU round times each op costs).  logits: [k+1, V]."""
    best = logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return n, best[n]


def saguaro_reshape(q: Tensor, c: float, num_top: int) -> Tensor:
    """Saguaro sampling (Kumar, Dao & May 2026, Def. 14): scale the probability of the
    ``num_top`` most likely tokens by ``c`` and renormalise.  q: [..., V].

    Lower ``c`` moves residual mass onto exactly the tokens the speculation cache
    holds as bonus candidates.  ``c == 1`` or ``num_top == 0`` returns ``q`` unchanged.
    The draft must sample from the reshaped distribution and the verifier must use
    that same tensor in :func:`verify`; then the output stays exact.
    """
    if c >= 1.0 or num_top <= 0:
        return q
    top = torch.topk(q, min(num_top, q.shape[-1]), dim=-1).indices
    scale = torch.ones_like(q).scatter(-1, top, c)
    out = q * scale
    return out / out.sum(dim=-1, keepdim=True)
