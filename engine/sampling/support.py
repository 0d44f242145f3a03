"""The sampling distribution on its support: top-k before the softmax.

At the usual settings (top-k 40 of a 49,152-token vocabulary) a distribution has at most k tokens
with a probability above 0, so :func:`top_support` finds them with one top-k over the logits and
does the softmax, the nucleus (top-p) and the draw over those k entries only: no sort of the
vocabulary and no multinomial over it.  The result is the distribution :func:`sampling.apply_top_k_top_p`
defines (the dense reference), with its tie rules:

* top-k keeps every token whose logit equals the k-th largest, so a tie across the k-th place keeps
  more than k tokens; :func:`top_support` returns None then and the caller takes the dense path;
* top-p walks the tokens by descending logit, equal logits by ascending id (a stable sort), and
  drops a token once the mass before it reaches top-p (the first token always stays).

:func:`draw` samples by inverse CDF with a float64 uniform, on the support or on a dense row alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .host import on_host

BLOCK = 128  # :func:`topk` splits the vocabulary into blocks of this many logits


@dataclass(frozen=True)
class Support:
    """Distributions [..., V] held on their support: ``ids`` [..., m] by descending logit (ties by
    ascending id) and their ``probs`` [..., m] (0 where top-p dropped the token)."""

    ids: Tensor
    probs: Tensor
    vocab: int

    def dense(self) -> Tensor:
        """The distributions as [..., V] float32 (what verify and the speculator's channel take)."""
        out = torch.zeros(*self.ids.shape[:-1], self.vocab, dtype=torch.float32, device=self.ids.device)
        return out.scatter_(-1, self.ids, self.probs)

    def sample(self, gen: torch.Generator) -> Tensor:
        """One token id per distribution ([...] int64)."""
        return self.ids.gather(-1, draw(self.probs, gen)[..., None])[..., 0]

    def saguaro(self, c: float, num_top: int) -> "Support":
        """:func:`sampling.saguaro_reshape` on the support: the ``num_top`` most likely tokens are the
        first ``num_top`` entries (the proposal only has to be the one the draft draws from)."""
        if c >= 1.0 or num_top <= 0:
            return self
        scale = torch.ones_like(self.probs)
        scale[..., :num_top] = c
        out = self.probs * scale
        return Support(self.ids, out / out.sum(dim=-1, keepdim=True), self.vocab)

    def __getitem__(self, i) -> "Support":
        """The distributions at index ``i`` of the leading dims."""
        return Support(self.ids[i], self.probs[i], self.vocab)


def stack(qs: list[Tensor | Support], dim: int) -> Tensor | Support:
    """Distributions (dense [..., V] or on their support) stacked along ``dim`` of the leading dims:
    on the support when every one has it (they share top-k, so their widths agree), else dense."""
    if all(isinstance(q, Support) for q in qs):
        return Support(torch.stack([q.ids for q in qs], dim), torch.stack([q.probs for q in qs], dim), qs[0].vocab)  # type: ignore[union-attr]
    return torch.stack([as_dense(q) for q in qs], dim)


def as_dense(q: Tensor | Support) -> Tensor:
    """``q`` as [..., V] float32."""
    return q.dense() if isinstance(q, Support) else q


def top_support(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Support | None:
    """The distributions of the (penalized) ``logits`` [..., V] float32 at ``temperature`` > 0 under
    top-k then top-p, or None where this path does not apply: top-k off, or a tie across the k-th
    place (both need the dense path).  The tie test is one read of k bools: on the CPU that costs
    nothing; the caller keeps other devices on the dense path, which never waits for the device.
    Where no two of the k values are equal, topk's descending order is the dense path's order.

    Only the k + 1 largest are divided by the temperature: division keeps the order (equal logits stay
    equal, and unequal ones may become equal), so they are the k + 1 largest of the scaled logits,
    with the values the dense path divides; a tie among them is found after the division."""
    vocab = logits.shape[-1]
    if not 0 < top_k < vocab:
        return None
    vals, ids = topk(logits, top_k + 1)  # by descending value
    vals = vals / temperature
    # equal neighbours at each place, in any row: one read answers both questions below
    eq = on_host((vals[..., 1:] == vals[..., :-1]).reshape(-1, top_k).any(dim=0), "tie check")
    if eq[-1]:
        return None
    vals, ids = vals[..., :top_k], ids[..., :top_k]
    if any(eq):  # the dense path's order: equal logits by ascending id (topk leaves ties unordered)
        by_id = ids.argsort(dim=-1)
        ids, vals = ids.gather(-1, by_id), vals.gather(-1, by_id)
        vals, by_val = vals.sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(-1, by_val)
    probs = torch.softmax(vals, dim=-1)
    if top_p < 1.0:
        drop = (probs.cumsum(dim=-1) - probs) >= top_p  # the mass before the token already reaches top_p
        drop[..., 0] = False
        probs = torch.softmax(vals.masked_fill(drop, float("-inf")), dim=-1)
    return Support(ids, probs, vocab)


def topk(x: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """``torch.topk(x, n)`` over the last dim (values descending; which of equal values is returned is
    unspecified in both), in a third of the time for a large vocabulary: the n largest lie in the n
    blocks with the largest maxima, so one max per block and a top-n over n blocks replace a top-n
    over the vocabulary.  (If more than n blocks reach the n-th value, each holds one such value, so
    the values returned are the same.)"""
    vocab = x.shape[-1]
    blocks = vocab // BLOCK
    if vocab % BLOCK or blocks < 4 * n:
        return torch.topk(x, n, dim=-1)
    lead = x.shape[:-1]
    xb = x.reshape(*lead, blocks, BLOCK)
    best = torch.topk(xb.amax(dim=-1), n, dim=-1).indices  # [..., n]
    cand = xb.gather(-2, best[..., None].expand(*lead, n, BLOCK)).reshape(*lead, n * BLOCK)
    vals, pos = torch.topk(cand, n, dim=-1)
    return vals, best.gather(-1, pos // BLOCK) * BLOCK + pos % BLOCK


def draw(probs: Tensor, gen: torch.Generator) -> Tensor:
    """An index per row of ``probs`` [..., m] (weights >= 0, not necessarily normalised), drawn by
    inverse CDF: the first index whose cumulative weight exceeds u * total, u ~ U[0, 1) in float64.
    An index of weight 0 is never drawn (its cumulative weight equals the one before it; the clamp
    to the last positive index covers u * total rounding up to the total)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[..., -1:].contiguous()
    u = torch.rand(total.shape, generator=gen, dtype=torch.float64, device=probs.device)
    idx = torch.searchsorted(cdf, u * total, right=True)
    last = torch.searchsorted(cdf, total, right=False)  # the last index of positive weight
    return torch.minimum(idx, last)[..., 0]
