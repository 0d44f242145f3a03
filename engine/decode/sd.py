"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): the baseline SSD must beat.

Each round the draft proposes k tokens autoregressively, the target scores
``[last, d1..dk]`` in one forward, and :func:`outcome.sampled` (:func:`sampling.verify` on the
device) accepts a prefix and samples the bonus token.  The drafts stay on the device until the
round's outcome is read, once (:mod:`host`).  The output is distributed exactly as the target's (greedy:
identical to :class:`ARDecoder`), because p and q go through the same
temperature / top-k / top-p transform and verify uses the very q the drafts were drawn from.

Bookkeeping.  ``seq`` is prompt + reply so far.  The target runner holds every token of
``seq`` but the last, which is fed at the start of the next verification.  The draft
(:mod:`drafting`: a model draft or a feature draft, behind one interface) holds some prefix
of ``seq`` and catches up before drafting.  Rollback after a round is truncation only;
accepted tokens are never recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch

from ..drafts.drafter import drafter, fit_vocab, plain_choice, vocab_size  # noqa: F401 - fit_vocab/vocab_size: SD's public helpers
from ..errors import ParamError
from ..events import Event, Round
from ..load.models import LoadedModel
from ..params import SamplingParams
from .decoder import Decoder, Noticing, ReplyFrame, context_budget, emit_block
from ..sampling.penalties import Penalties
from . import outcome
from .outcome import chain_rows
from ..sampling.sampling import logits_to_probs, make_generator


class SDDecoder(Decoder):
    mode = "sd"

    def __init__(self, engine: Any) -> None:
        if engine.draft is None:
            raise ParamError("speculative decoding needs a draft model (--draft copy|int8|layers:N|MODEL)")
        self.engine = engine
        self.target: LoadedModel = engine.target
        self.draft: LoadedModel = engine.draft
        self.k: int = engine.config.k
        self._vocab = vocab_size(self.target.model)

    def _budget(self, num_prompt: int, params: SamplingParams) -> int:
        return min(context_budget(self.target, num_prompt, params), context_budget(self.draft, num_prompt, params))

    def _noticed(self) -> tuple[Noticing, ...]:
        return self.target.forwards, self.draft.forwards

    def _reply(self, prompt_ids: list[int], r: ReplyFrame) -> Generator[Event, None, None]:
        tdev, ddev, params, builder, metrics = self.target.device, self.draft.device, r.params, r.builder, r.metrics
        gen = make_generator(params.seed, tdev)
        # the draft samples with its own generator on its own device (a different stream of the same seed)
        dgen = gen if ddev == tdev else make_generator(None if params.seed is None else params.seed + 1, ddev)
        # the penalties' reply counts, on each model's device (the same tokens)
        tpen = Penalties.of(params, prompt_ids)
        dpen = tpen if ddev == tdev else Penalties.of(params, prompt_ids)
        choose = plain_choice(params, dgen, dpen)
        mode = self.engine.config.compile
        draft = drafter(self.draft.forwards, self._vocab, ddev, mode, (1, self.k + 1))
        features = draft.reads_features  # the target's hidden states go to the draft
        target = self.target.forwards.runner("target", mode, (self.k + 1,), tdev, draft.mid_layer)
        # prefill: everything but the last prompt token, which the first round feeds
        seq = list(prompt_ids)
        if len(seq) > 1:
            draft.prefill(seq[:-1], target.append(seq[:-1], logits="last", hidden=features))
        metrics.prefill_s = time.perf_counter() - r.t0
        index = 0
        while (yield from r.go_on()):
            # never draft past the budget: k drafts + 1 bonus <= remaining
            k = max(0, min(self.k, builder.remaining - 1))
            num_seq = len(seq)

            # draft: catch up on the tokens it has not seen, then propose k tokens from q (on the device)
            t_draft = time.perf_counter()
            drafted, qs = draft.propose(seq, k, choose) if k else (torch.zeros(0, dtype=torch.long, device=ddev), [])
            draft_s = time.perf_counter() - t_draft

            # verify: one target forward over [last, d1..dk], the acceptance test on the device, one read
            t_verify = time.perf_counter()
            d = drafted.to(tdev)
            out = target.append(torch.cat([torch.tensor([seq[-1]], device=tdev), d]), hidden=features)  # logits [k+1, V]
            # row i follows seq + drafts[:i]: penalized for exactly that prefix, as AR would
            rows = chain_rows(tpen, out.logits, d)
            if params.temperature == 0.0:  # point masses: one argmax decides
                n_t, bonus_t = outcome.greedy(rows, d)
            else:
                p = logits_to_probs(rows, params.temperature, params.top_k, params.top_p)  # [k+1, V]
                q = torch.stack(qs).to(tdev) if k else p[:0]  # [k, V]
                n_t, bonus_t = outcome.sampled(d, q, p, gen)
            drafts, num_accepted, bonus = outcome.decided(d, n_t, bonus_t)  # the round's one device read
            # roll back: both keep [.., last, d1..dn]
            target.truncate(num_seq + num_accepted)
            draft.rollback(num_seq + num_accepted, out)
            verify_s = time.perf_counter() - t_verify

            # emit the accepted drafts and the bonus; EOS / stop / length end the reply at that token
            emitted, bonus_id = yield from emit_block(builder, metrics, drafts, num_accepted, bonus, r.t0,
                                                         out.logits, params.logprobs)
            seq += [*drafts[:num_accepted], bonus]  # only read again if the reply goes on
            for pen in {id(tpen): tpen, id(dpen): dpen}.values():
                pen.add([*drafts[:num_accepted], bonus])
            rnd = Round(index, tuple(drafts), num_accepted, bonus_id, emitted, draft_s, verify_s, time.perf_counter() - r.t0)
            metrics.add(rnd)
            yield rnd
            index += 1
