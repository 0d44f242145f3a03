"""One reply's token history as the penalties read it (repetition / frequency / presence).

:class:`Penalties` keeps two tensors per reply, updated incrementally as tokens are committed:
``prompt_seen`` [V] (which tokens the prompt holds) and ``counts`` [V] (how often each token
occurs in the reply).  A speculative round needs logits penalized for *several* prefixes at once:
row i of the target's k+1 verification rows follows ``committed + chain[:i]``, a tree branch its
own hypothesised prefix.  :meth:`rows` and :meth:`with_extra` add those per-row tokens on top of
the committed counts, so every row is penalized exactly as AR would penalize it at that prefix.
The verifier's rows must be exact (they are the target distribution); the draft's rows only
change the acceptance rate.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .sampling import apply_penalties


class Penalties:
    """``prompt``: the tokens that count only for the repetition penalty; ``reply``: tokens already
    generated (e.g. an SSD reply continued in this process).  Tensors are sized on first use from the
    logits' width (tokens at or past it are ignored: they cannot be sampled)."""

    def __init__(self, repetition: float = 1.0, frequency: float = 0.0, presence: float = 0.0,
                 prompt: Sequence[int] = (), reply: Sequence[int] = ()) -> None:
        self.repetition, self.frequency, self.presence = repetition, frequency, presence
        self.active = repetition != 1.0 or frequency != 0.0 or presence != 0.0
        self._prompt = list(prompt)
        self._reply = list(reply)  # committed before the tensors exist
        self.prompt_seen: Tensor | None = None
        self.counts: Tensor | None = None

    @classmethod
    def of(cls, params, prompt: Sequence[int] = (), reply: Sequence[int] = ()) -> "Penalties":
        """From anything with the three penalty fields (SamplingParams, the speculator's Settings)."""
        return cls(params.repetition_penalty, params.frequency_penalty, params.presence_penalty, prompt, reply)

    @torch.inference_mode()  # one mode for the counts, whichever mode the caller is in (the speculator's build is in it)
    def _tensors(self, like: Tensor) -> tuple[Tensor, Tensor]:
        if self.counts is None:
            v, dev = like.shape[-1], like.device
            self.prompt_seen = torch.zeros(v, dtype=torch.bool, device=dev)
            ids = torch.tensor([t for t in self._prompt if 0 <= t < v], dtype=torch.long, device=dev)
            self.prompt_seen[ids] = True
            self.counts = torch.zeros(v, dtype=torch.float32, device=dev)
            self._prompt = []
            self.add(self._reply)
        assert self.prompt_seen is not None
        return self.prompt_seen, self.counts

    @torch.inference_mode()
    def add(self, tokens: Sequence[int]) -> None:
        """Commit reply tokens."""
        if not self.active or not tokens:
            return
        if self.counts is None:
            self._reply.extend(tokens)
            return
        v = self.counts.shape[0]
        ids = torch.tensor([t for t in tokens if 0 <= t < v], dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, ids, torch.ones(ids.shape[0], device=self.counts.device))

    def with_extra(self, logits: Tensor, extra: Tensor | None) -> Tensor:
        """Penalized ``logits`` [R, V] (or [V]); row r also counts ``extra[r]`` [R, V] reply tokens
        beyond the committed ones.  Returns ``logits`` itself when no penalty is set."""
        if not self.active:
            return logits
        seen, counts = self._tensors(logits)
        c = counts if extra is None else counts + extra
        return apply_penalties(logits, seen | (c > 0), c, self.repetition, self.frequency, self.presence)

    def rows(self, logits: Tensor, chain: Sequence[int] = (), start: int = 0) -> Tensor:
        """Penalized ``logits`` [R, V] where row r follows the committed tokens + ``chain[:start + r]``
        (a verification: chain = the fed tokens; one draft step: R = 1, start = tokens drawn so far)."""
        if not self.active:
            return logits
        n = start + logits.shape[0] - 1  # the last row follows chain[:n]
        if n <= 0:
            return self.with_extra(logits, None)
        return self.with_extra(logits, chain_counts(chain[:n], logits.shape[-1], logits.device)[start:])

    def extra_for(self, prefixes: Sequence[Sequence[int]], like: Tensor) -> Tensor:
        """Counts [B, V] of each row's own uncommitted tokens (a tree's branches)."""
        v = like.shape[-1]
        out = torch.zeros(len(prefixes), v, dtype=torch.float32, device=like.device)
        for b, toks in enumerate(prefixes):
            ids = torch.tensor([t for t in toks if 0 <= t < v], dtype=torch.long, device=like.device)
            out[b].index_add_(0, ids, torch.ones(ids.shape[0], device=like.device))
        return out


def chain_counts(chain: Sequence[int], vocab: int, device: torch.device) -> Tensor:
    """[len(chain) + 1, V]: row i counts ``chain[:i]``."""
    out = torch.zeros(len(chain) + 1, vocab, dtype=torch.float32, device=device)
    if chain:
        ids = torch.tensor([t if 0 <= t < vocab else 0 for t in chain], dtype=torch.long, device=device)
        ok = torch.tensor([1.0 if 0 <= t < vocab else 0.0 for t in chain], device=device)
        out[1:] = torch.zeros(len(chain), vocab, device=device).scatter_(1, ids[:, None], ok[:, None]).cumsum(0)
    return out
