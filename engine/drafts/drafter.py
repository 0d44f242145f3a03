"""Drafts behind one interface: what SD (and SSD's in-process fallback) asks of a draft.

A drafter keeps the draft model's view of the sequence being decoded: ``prefill``, ``propose``
(catch up on ``seq``, then draft k tokens drawn by the caller's ``choose``, which owns the sampling
rule; the tokens stay on the device and are fed back as tensors, so drafting never waits for a
device read) and ``rollback``.  :class:`ModelDrafter` serves any causal LM; :class:`FeatureDrafter`
a feature draft, which reads the target's hidden state at the position before each token
(``reads_features``: the target runner must return it, with layer ``mid_layer``'s output for a
fused draft).  :func:`drafter` picks one.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..model import runner as kv
from ..model.forward import Forwards
from ..sampling.penalties import Penalties
from ..sampling.sampling import draw_draft
from ..threads import pinned
from .feature import FeatureDraft, is_feature_draft

Choose = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]  # (token, 0-dim on the device; q or None)


def plain_choice(params: Any, gen: torch.Generator, pen: Penalties | None = None, before: tuple[int, ...] = ()) -> Choose:
    """SD's rule for drawing a draft token: q is the draft's distribution under the target's
    penalties / temperature / top-k / top-p (None under greedy: a point mass on the argmax).  The i-th
    draft token is penalized for the committed tokens, the uncommitted ``before`` them (SSD's
    in-process fallback: the bonus) and the i drawn before it this round.  The token stays on the
    device: the counts of the drawn ones are kept there too, so a draft step reads nothing."""
    drawn: list[torch.Tensor] = []  # the tokens drawn so far this round, on the device

    def choose(logits: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        penalized = pen is not None and pen.active
        if penalized:
            if i == 0:
                drawn.clear()
            so_far = torch.cat(drawn).reshape(1, -1) if drawn else None
            logits = pen.apply(logits[None], [list(before)], so_far)[0]  # type: ignore[union-attr]
        tok, q = draw_draft(logits, params.temperature, params.top_k, params.top_p, gen)
        if penalized:
            drawn.append(tok.reshape(1))
        return tok, q
    return choose



def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output head (the width of its logits)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    if callable(weight):  # dynamic-quantized Linear: weight() returns the packed tensor
        return int(weight().shape[0])
    return int(model.config.vocab_size)


def fit_vocab(logits: torch.Tensor, size: int | None) -> torch.Tensor:
    """Draft logits [..., Vd] -> [..., size]: pad with -inf (tokens the draft cannot propose) or cut.
    Same-tokenizer models can still differ in head width (padded vocabularies)."""
    vd = logits.shape[-1]
    if size is None or vd == size:
        return logits
    if vd > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - vd), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def draft_k(logits: torch.Tensor, k: int, choose: Choose, vocab: int | None,
            step: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Draw k tokens: ``logits`` are the draft's for the first; ``step(token)`` feeds a drawn token
    ([1], on the device) and gives the logits for the next (not called after the last, which the
    draft never sees).  Returns the tokens [k] (long, on the device) and their q rows."""
    tokens: list[torch.Tensor] = []
    qs: list[torch.Tensor | None] = []
    for i in range(k):
        tok, q = choose(fit_vocab(logits, vocab), i)
        tokens.append(tok.reshape(1))
        qs.append(q)
        if i < k - 1:
            logits = step(tokens[-1])
    return (torch.cat(tokens).long() if tokens else torch.zeros(0, dtype=torch.long, device=logits.device)), qs


class ModelDrafter:
    """A causal LM as a draft: its own KV cache over a prefix of the sequence."""

    reads_features = False
    mid_layer: int | None = None

    def __init__(self, forwards: Forwards, vocab: int | None, device: torch.device | None = None,
                 compile: str = "off", rows: tuple[int, ...] = (1,)) -> None:
        self.runner = forwards.runner("draft", compile, rows, device)
        self.vocab = vocab
        compiler = getattr(getattr(self.runner, "core", None), "compiler", None)
        # an eager draft on CPU runs on one thread: its small products finish before a second thread
        # wakes (SD on 2 threads drafted slower than on 1), while the target's graphs use them all
        self.solo = self.runner.device.type == "cpu" and not (compiler is not None and compiler.active)

    def prefill(self, ids: list[int], target_out: Any = None) -> None:
        if ids:
            with pinned(None, 1 if self.solo else None):
                self.runner.append(ids, logits="none")

    def propose(self, seq: list[int], k: int, choose: Choose) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        with pinned(None, 1 if self.solo else None):
            logits = self.runner.append(seq[self.runner.length:], logits="last").logits[-1]
            return draft_k(logits, k, choose, self.vocab, lambda tok: self.runner.append(tok).logits[-1])

    def rollback(self, keep: int, target_out: Any = None) -> None:
        # the draft never saw the last drafted token, so it may hold less than `keep`
        self.runner.truncate(min(self.runner.length, keep))


class FeatureDrafter:
    """A feature draft's cache over a prefix of the sequence in which every token was fed the
    target's true feature, plus those features.

    ``feats[p]`` is the target's feature at position p (known for every position the target has
    run).  :meth:`catch_up` feeds the tokens of ``seq`` not yet cached with their true features;
    drafted tokens are fed the draft's own hidden state and dropped again on rollback."""

    reads_features = True

    def __init__(self, model: FeatureDraft, vocab: int | None, device: torch.device | None = None) -> None:
        self.model = model
        self.mid_layer = model.fuse_layer
        self.runner = kv.Runner(model, device=device)
        self.device = self.runner.device
        self.vocab = vocab
        self.feats = torch.zeros(0, model.hidden_size, device=self.device, dtype=model.fc.weight.dtype)
        self.valid = 0  # cached positions fed true features

    def prefill(self, ids: list[int], target_out: Any = None) -> None:
        if ids:
            self.add_features(target_features(target_out), 0)

    def add_features(self, f: torch.Tensor, start: int) -> None:
        """Target features (as :func:`target_features` gives them) for positions
        ``start..start+len(f)-1``, replacing what was there."""
        with torch.no_grad():
            g = self.model.true_features(f.to(self.device, self.feats.dtype))
        self.feats = torch.cat([self.feats[:start], g], dim=0)

    def _feat_in(self, start: int, n: int) -> torch.Tensor:
        """Input features for tokens at positions start..start+n-1: feats[p-1] (zeros for p = 0)."""
        lo = max(start - 1, 0)
        f = self.feats[lo : start + n - 1]
        if start == 0:
            f = torch.cat([f.new_zeros(1, f.shape[-1]), f], dim=0)
        if f.shape[0] != n:
            raise RuntimeError(f"feature draft: features for positions {start}..{start + n - 1} are not known")
        return f

    def forward(self, ids: list[int] | torch.Tensor, feats: torch.Tensor | None = None, last_only: bool = False) -> kv.Out:
        """Append ``ids`` fed ``feats`` (default: their true features); logits and the draft's hidden states."""
        f = self._feat_in(self.runner.length, len(ids)) if feats is None else feats
        return self.runner.append(ids, logits="last" if last_only else "all", hidden=True, features=f)

    def catch_up(self, seq: list[int]) -> kv.Out:
        """Feed ``seq[valid:]`` with their true features; returns the last position's output."""
        self.runner.truncate(self.valid)
        out = self.forward(seq[self.valid:], last_only=True)
        self.valid = len(seq)
        return out

    def propose(self, seq: list[int], k: int, choose: Choose) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        out = self.catch_up(seq)
        hidden = out.hidden[-1:]

        def step(tok: torch.Tensor) -> torch.Tensor:  # a drafted position's feature is the draft's own hidden state
            nonlocal hidden
            nxt = self.forward(tok, feats=hidden)
            hidden = nxt.hidden[-1:]
            return nxt.logits[-1]

        return draft_k(out.logits[-1], k, choose, self.vocab, step)

    def rollback(self, keep: int, target_out: Any = None) -> None:
        start = self.feats.shape[0]  # the verified block starts at the first position without a feature
        self.add_features(target_features(target_out)[: keep - start], start)
        self.runner.truncate(self.valid)


def target_features(out: kv.Out) -> torch.Tensor:
    """The target's features in a forward's output: its final normed hidden states [T, H], or for
    a fused draft [T, 2H] = [output of layer ``mid_layer`` | final], what
    :meth:`FeatureDraft.true_features` reads."""
    if out.mid is None:
        return out.hidden
    return torch.cat([out.mid.to(out.hidden.dtype), out.hidden], dim=-1)


def drafter(forwards: Forwards, vocab: int | None, device: torch.device | None = None, compile: str = "off",
            rows: tuple[int, ...] = (1,)) -> ModelDrafter | FeatureDrafter:
    """The drafter for the model of ``forwards``: a model draft on the runner its handle picks
    (``compile``, compiled ``rows``); a feature draft always on transformers (it reads the target's features)."""
    if is_feature_draft(forwards.model):
        return FeatureDrafter(forwards.model, vocab, device)
    return ModelDrafter(forwards, vocab, device, compile, rows)
