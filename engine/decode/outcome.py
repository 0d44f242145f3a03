"""A round's outcome decided on the device, read on the host once.

:func:`greedy` and :func:`sampled` are :func:`sampling.greedy_outcome` and :func:`sampling.verify`
with nothing read back: the accepted length ``n`` and the bonus token stay tensors, so the draft
tokens, ``n`` and the bonus come back in one :func:`host.read` per round (:func:`decided`).  They
draw the same random numbers in the same order as those functions (``torch.rand(k)``, then one
``multinomial``), so a seeded reply is the same token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..sampling.host import read
from ..sampling.penalties import Penalties
from ..sampling.sampling import residual, sample


def greedy(logits: Tensor, drafts: Tensor) -> tuple[Tensor, Tensor]:
    """(n, bonus), 0-dim: a draft token is accepted while it is the target's argmax; the bonus is the
    argmax after the accepted prefix.  logits [k+1, V], drafts [k] on the same device."""
    best = logits.argmax(dim=-1)  # [k+1]
    k = drafts.shape[0]
    n = (drafts == best[:k]).long().cumprod(0).sum() if k else best.new_zeros(())
    return n, best.gather(0, n[None])[0]


def sampled(drafts: Tensor, q: Tensor, p: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """(n, bonus), 0-dim: speculative sampling (see :func:`sampling.verify`) for drafts [k] drawn from
    q [k, V], against the target's p [k+1, V]."""
    k = drafts.shape[0]
    if not k:
        return drafts.new_zeros(()), sample(p[0], gen)
    rows = torch.arange(k, device=p.device)
    p_d, q_d = p[rows, drafts], q[rows, drafts]
    u = torch.rand(k, generator=gen, device=p.device)
    ok = (u * q_d <= p_d) & (p_d > 0)  # accept while u <= p/q, without a division
    n = ok.long().cumprod(0).sum()
    i = n.clamp(max=k - 1)[None]
    dist = torch.where(n < k, residual(p.index_select(0, i)[0], q.index_select(0, i)[0]), p[k])
    return n, sample(dist, gen)


def decided(drafts: Tensor, n: Tensor, bonus: Tensor) -> tuple[list[int], int, int]:
    """The round's one read: (the draft tokens, accepted length, bonus) on the host."""
    vals = read(torch.cat([drafts.to(n.device, torch.long), n.reshape(1), bonus.reshape(1).to(torch.long)]), "round")
    return vals[:-2], vals[-2], vals[-1]


def chain_rows(pen: Penalties, logits: Tensor, chain: Tensor) -> Tensor:
    """:meth:`Penalties.rows` for a chain still on the device: row r of ``logits`` [k+1, V] penalized
    for the committed tokens + ``chain[:r]`` (chain [k], tokens below V)."""
    if not pen.active:
        return logits
    k = chain.shape[0]
    toks = chain.to(logits.device, torch.long)[None].expand(k + 1, k)
    valid = torch.arange(k, device=logits.device)[None] < torch.arange(k + 1, device=logits.device)[:, None]
    return pen.apply(logits, None, toks, valid)
