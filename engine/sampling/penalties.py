"""One reply's token history as the penalties read it (repetition / frequency / presence).

:class:`Penalties` keeps, per reply, which tokens occur (``seen`` [V]: prompt or reply), how often each
occurs in the reply (``counts`` [V]) and the distinct ids seen so far (``ids``), all updated as tokens
are committed, so a step touches only those ids: a gather, the formulas, a scatter, never a pass
over the vocabulary or the history.  A speculative round needs logits penalized for *several*
prefixes at once: row i of the target's k+1 verification rows follows ``committed + chain[:i]``, a
tree branch its own hypothesised prefix.  :meth:`apply` takes each row's uncommitted tokens and
penalizes the row exactly as AR would at that prefix.  The verifier's rows must be exact (they are
the target distribution); the draft's rows only change the acceptance rate.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

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
        self.seen: Tensor | None = None  # [V] bool: in the prompt or the reply
        self.counts: Tensor | None = None  # [V] float32: occurrences in the reply
        self._ids: Tensor | None = None  # the distinct seen ids, in order of appearance: _ids[:_n]
        self._n = 0
        self._known: set[int] = set()

    @classmethod
    def of(cls, params, prompt: Sequence[int] = (), reply: Sequence[int] = ()) -> "Penalties":
        """From a reply's SamplingParams."""
        return cls(params.repetition_penalty, params.frequency_penalty, params.presence_penalty, prompt, reply)

    @torch.inference_mode()  # one mode for the counts, whichever mode the caller is in (the speculator's build is in it)
    def _tensors(self, like: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.counts is None:
            v, dev = like.shape[-1], like.device
            self.seen = torch.zeros(v, dtype=torch.bool, device=dev)
            self.counts = torch.zeros(v, dtype=torch.float32, device=dev)
            self._ids = torch.empty(64, dtype=torch.long, device=dev)
            self._see(self._prompt)
            self._prompt = []
            self.add(self._reply)
        assert self.seen is not None and self._ids is not None
        return self.seen, self.counts, self._ids[: self._n]

    def _see(self, tokens: Sequence[int]) -> list[int]:
        """Mark ``tokens`` seen; returns those in the vocabulary."""
        assert self.seen is not None and self._ids is not None
        v = self.seen.shape[0]
        valid = [t for t in tokens if 0 <= t < v]
        new = [t for t in dict.fromkeys(valid) if t not in self._known]
        if new:
            self._known.update(new)
            if self._n + len(new) > self._ids.shape[0]:
                grown = torch.empty(2 * (self._n + len(new)), dtype=torch.long, device=self._ids.device)
                grown[: self._n] = self._ids[: self._n]
                self._ids = grown
            fresh = torch.tensor(new, dtype=torch.long, device=self.seen.device)
            self._ids[self._n: self._n + len(new)] = fresh
            self._n += len(new)
            self.seen[fresh] = True
        return valid

    @torch.inference_mode()
    def add(self, tokens: Sequence[int]) -> None:
        """Commit reply tokens."""
        if not self.active or not tokens:
            return
        if self.counts is None:
            self._reply.extend(tokens)
            return
        valid = self._see(tokens)
        if valid:
            ids = torch.tensor(valid, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones(len(valid), device=self.counts.device))

    @torch.no_grad()  # the committed state is made in inference mode; a caller's logits may track gradients
    def apply(self, logits: Tensor, prefixes: Sequence[Sequence[int]] | None = None, drawn: Tensor | None = None,
              drawn_valid: Tensor | None = None) -> Tensor:
        """Penalized ``logits`` [R, V] (or [V]), float32, a new tensor; row r also counts its own
        uncommitted tokens ``prefixes[r]`` and ``drawn[r]`` ([R, d] ids on the device: a tree's draws so
        far; ``drawn_valid`` [R, d] bool, if given, says which of them count) beyond the committed ones.
        Returns ``logits`` itself when no penalty is set."""
        if not self.active:
            return logits
        out = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        self._penalize(out.view(-1, out.shape[-1]), prefixes, drawn, drawn_valid)
        return out

    @contextmanager
    def applied(self, logits: Tensor, prefixes: Sequence[Sequence[int]] | None = None, drawn: Tensor | None = None,
                drawn_valid: Tensor | None = None) -> Iterator[Tensor]:
        """:meth:`apply` done in place on float32 ``logits`` [R, V], which get their values back, bit for
        bit, when the block ends (a copy of another type or shape otherwise).  The speculator's tree
        depth: a fresh [R, V] copy costs more than its draw on a CPU (page faults, and a second copy for
        the top-k to read from memory instead of the cache)."""
        if not self.active or logits.dtype != torch.float32 or logits.dim() != 2:
            yield self.apply(logits, prefixes, drawn, drawn_valid)
            return
        with torch.inference_mode():  # in-place on the caller's tensor, whichever mode it was made in
            undo = self._penalize(logits, prefixes, drawn, drawn_valid)
        try:
            yield logits
        finally:
            with torch.inference_mode():
                for cols, raw in undo:  # raw values: where a column repeats, every copy holds the same
                    if cols.dim() == 1:
                        logits[:, cols] = raw
                    else:
                        logits.scatter_(1, cols, raw)

    def _penalize(self, flat: Tensor, prefixes: Sequence[Sequence[int]] | None, drawn: Tensor | None,
                  drawn_valid: Tensor | None) -> list[tuple[Tensor, Tensor]]:
        """Penalize ``flat`` [R, V] float32 in place; returns the (columns, raw values) it overwrote."""
        seen, counts, ids = self._tensors(flat)
        fix = lambda raw, s, c: apply_penalties(raw, s, c, self.repetition, self.frequency, self.presence)  # noqa: E731
        undo: list[tuple[Tensor, Tensor]] = []
        extra = _extra(prefixes, drawn, drawn_valid, flat.shape[0], flat.shape[-1], flat.device)
        if extra is not None:  # read before the committed ids are rewritten: they are fixed from the raw logits
            extra_raw = flat.gather(1, extra[0])
            undo.append((extra[0], extra_raw))
        if ids.numel():  # every committed id: seen, with its reply count
            raw = flat[:, ids]
            flat[:, ids] = fix(raw, torch.ones_like(ids, dtype=torch.bool), counts[ids])
            undo.append((ids, raw))
        if extra is not None:  # the row's own count on top of the reply's, so never twice
            toks, valid = extra
            own = ((toks[:, :, None] == toks[:, None, :]) & valid[:, None, :]).sum(-1).float()  # [R, m]
            c = counts[toks] + own
            flat.scatter_(1, toks, fix(extra_raw, seen[toks] | (c > 0), c))
        return undo

    def rows(self, logits: Tensor, chain: Sequence[int] = (), start: int = 0) -> Tensor:
        """Penalized ``logits`` [R, V] where row r follows the committed tokens + ``chain[:start + r]``
        (a verification: chain = the fed tokens; one draft step: R = 1, start = tokens drawn so far)."""
        if not self.active:
            return logits
        return self.apply(logits, [chain[: start + r] for r in range(logits.shape[0])])


def _extra(prefixes: Sequence[Sequence[int]] | None, drawn: Tensor | None, drawn_valid: Tensor | None, rows: int,
           vocab: int, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """Each row's uncommitted tokens as ids [R, m] and a mask [R, m] of the real ones.  A padding or
    out-of-vocabulary slot repeats another id of its row (or 0) unmasked: it rewrites that id with
    the same value, which counts only the masked-in tokens."""
    lists = [[t for t in p if 0 <= t < vocab] for p in prefixes] if prefixes is not None else [[] for _ in range(rows)]
    width = max((len(p) for p in lists), default=0)
    parts: list[tuple[Tensor, Tensor]] = []
    if width:
        pad = [p + [p[0] if p else 0] * (width - len(p)) for p in lists]
        mask = [[True] * len(p) + [False] * (width - len(p)) for p in lists]
        parts.append((torch.tensor(pad, dtype=torch.long, device=device), torch.tensor(mask, device=device)))
    if drawn is not None and drawn.shape[-1]:
        valid = torch.ones(drawn.shape, dtype=torch.bool, device=device) if drawn_valid is None else drawn_valid.to(device)
        parts.append((drawn.to(device=device, dtype=torch.long), valid))
    if not parts:
        return None
    return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
