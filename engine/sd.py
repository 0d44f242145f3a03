"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): the baseline SSD must beat.

Each round the draft proposes k tokens autoregressively, the target scores
``[last, d1..dk]`` in one forward, and :func:`sampling.verify` accepts a prefix and
samples the bonus token.  The output is distributed exactly as the target's (greedy:
identical to :class:`ARDecoder`), because p and q go through the same
temperature / top-k / top-p transform and verify uses the very q the drafts were drawn from.

Cache bookkeeping.  ``seq`` is prompt + reply so far.  The target cache holds every
token of ``seq`` but the last, which is fed at the start of the next verification.
The draft cache holds some prefix of ``seq`` (it lags by one or two tokens after a
round) and catches up with a single forward before drafting.  Rollback after a round
is truncation only; accepted tokens are never recomputed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import torch

from . import kv
from .feature_draft import FeatureState, FeatureTap, is_feature_draft
from .ar import context_budget, error_event
from .detok import ReplyBuilder
from .errors import ParamError
from .events import Done, Event, Round, Token
from .metrics import Metrics
from .models import LoadedModel
from .params import SamplingParams
from .sampling import logits_to_probs, make_generator, sample, verify


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's output head (the width of its logits)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    if callable(weight):  # dynamic-quantized Linear: weight() returns the packed tensor
        return int(weight().shape[0])
    return int(model.config.vocab_size)


def fit_vocab(logits: torch.Tensor, size: int) -> torch.Tensor:
    """Draft logits [..., Vd] -> [..., size]: pad with -inf (tokens the draft cannot propose) or cut.

    Same-tokenizer models can still differ in head width (padded vocabularies)."""
    vd = logits.shape[-1]
    if vd == size:
        return logits
    if vd > size:
        return logits[..., :size]
    pad = logits.new_full((*logits.shape[:-1], size - vd), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


def emit_block(
    builder: ReplyBuilder, metrics: Metrics, drafts: list[int], num_accepted: int, bonus: int, t0: float
) -> Generator[Token, None, tuple[int, int | None]]:
    """Push one round's accepted drafts and bonus through ``builder``, yielding their Token
    events; EOS / stop / length end the block at that token.  Returns ``(emitted, bonus_id)``
    (bonus_id None if the reply ended before the bonus).  Shared by SD and SSD."""
    emitted, bonus_id = 0, None
    for i, tok in enumerate([*drafts[:num_accepted], bonus]):
        delta = builder.push(tok)
        if i == num_accepted:
            bonus_id = tok
        if builder.reason != "eos":
            ev = Token(tok, delta, "draft" if i < num_accepted else "target", time.perf_counter() - t0)
            emitted += 1
            metrics.add(ev)
            yield ev
        if builder.finished:
            break
    return emitted, bonus_id


class SDDecoder:
    mode = "sd"

    def __init__(self, engine: Any) -> None:
        if engine.draft is None:
            raise ParamError("speculative decoding needs a draft model (--draft copy|int8|layers:N|MODEL)")
        self.engine = engine
        self.target: LoadedModel = engine.target
        self.draft: LoadedModel = engine.draft
        self.k: int = engine.config.k
        self._vocab = vocab_size(self.target.model)

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, stop: threading.Event | None = None
    ) -> Iterator[Event]:
        t0 = time.perf_counter()
        tmodel, tdev = self.target.model, self.target.device
        dmodel, ddev = self.draft.model, self.draft.device
        budget = min(context_budget(self.target, len(prompt_ids), params), context_budget(self.draft, len(prompt_ids), params))
        builder = ReplyBuilder(self.target.tokenizer, self.target.eos_ids, params.stop, budget, params.ignore_eos)
        metrics = Metrics(self.mode)
        gen = make_generator(params.seed, tdev)
        # the draft samples with its own generator on its own device (a different stream of the same seed)
        dgen = gen if ddev == tdev else make_generator(None if params.seed is None else params.seed + 1, ddev)
        temp, top_k, top_p = params.temperature, params.top_k, params.top_p
        reason = None
        features = is_feature_draft(dmodel)
        tap = FeatureTap(tmodel, dmodel.fuse_layer) if features else None
        try:
            # prefill: everything but the last prompt token, which the first round feeds
            seq = list(prompt_ids)
            tcache = kv.new_cache(tmodel)
            fstate = FeatureState(dmodel, ddev) if features else None
            dcache = None if features else kv.new_cache(dmodel)
            if len(seq) > 1:
                kv.forward(tmodel, torch.tensor(seq[:-1], device=tdev), tcache, last_only=True)
                if fstate is not None:  # the target's features of seq[:-1]: the draft can read all of seq
                    fstate.add_features(tap.take(), 0)
                else:
                    kv.forward(dmodel, torch.tensor(seq[:-1], device=ddev), dcache, last_only=True)
            metrics.prefill_s = time.perf_counter() - t0
            index = 0
            while True:
                if stop is not None and stop.is_set():
                    reason = "cancelled"
                    break
                # never draft past the budget: k drafts + 1 bonus <= remaining
                k = max(0, min(self.k, builder.remaining - 1))
                num_seq = len(seq)

                # draft: catch up on the tokens it has not seen, then propose k tokens from q
                t_draft = time.perf_counter()
                drafts: list[int] = []
                qs: list[torch.Tensor] = []
                if k:
                    if fstate is not None:  # a feature draft: catch up on the target's features, then feed its own
                        out = fstate.catch_up(seq)
                        logits, hidden = out.logits[-1], out.hidden[-1:]
                    else:
                        new = torch.tensor(seq[kv.length(dcache) :], device=ddev)
                        logits = kv.forward(dmodel, new, dcache, last_only=True)[-1]
                    for i in range(k):
                        q = logits_to_probs(fit_vocab(logits, self._vocab), temp, top_k, top_p)  # [V]
                        d = int(q.argmax()) if temp == 0.0 else int(sample(q, dgen))
                        drafts.append(d)
                        qs.append(q)
                        if i < k - 1 and fstate is not None:
                            out = fstate.forward([d], feats=hidden)
                            logits, hidden = out.logits[-1], out.hidden[-1:]
                        elif i < k - 1:
                            logits = kv.forward(dmodel, torch.tensor([d], device=ddev), dcache)[-1]
                draft_s = time.perf_counter() - t_draft

                # verify: one target forward over [last, d1..dk], then accept a prefix and sample the bonus
                t_verify = time.perf_counter()
                logits = kv.forward(tmodel, torch.tensor([seq[-1], *drafts], device=tdev), tcache)  # [k+1, V]
                p = logits_to_probs(logits, temp, top_k, top_p)  # [k+1, V]
                q = torch.stack(qs).to(tdev) if k else p[:0]  # [k, V]
                num_accepted, bonus = verify(torch.tensor(drafts, dtype=torch.long, device=tdev), q, p, gen)
                # roll back: keep [.., last, d1..dn]; the draft never saw dk, so it may hold less
                kv.truncate(tcache, num_seq + num_accepted)
                if fstate is not None:  # true features of last, d1..dn; the draft drops what it drafted
                    fstate.add_features(tap.take()[: num_accepted + 1], num_seq - 1)
                    fstate.rollback()
                else:
                    kv.truncate(dcache, min(kv.length(dcache), num_seq + num_accepted))
                verify_s = time.perf_counter() - t_verify

                # emit the accepted drafts and the bonus; EOS / stop / length end the reply at that token
                emitted, bonus_id = yield from emit_block(builder, metrics, drafts, num_accepted, bonus, t0)
                seq += [*drafts[:num_accepted], bonus]  # only read again if the reply goes on
                rnd = Round(index, tuple(drafts), num_accepted, bonus_id, emitted, draft_s, verify_s, time.perf_counter() - t0)
                metrics.add(rnd)
                yield rnd
                index += 1
                if builder.finished:
                    reason = builder.reason
                    break
        except Exception as e:  # noqa: BLE001 - reported as an event, with the partial reply
            yield error_event(e, builder)
            return
        finally:
            if tap is not None:
                tap.close()
        yield Done(reason, builder.text + builder.flush(), tuple(builder.token_ids), metrics.stats(time.perf_counter() - t0))
