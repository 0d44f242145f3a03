"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): the baseline SSD must beat.

Each round the draft proposes k tokens autoregressively, the target scores
``[last, d1..dk]`` in one forward, and :func:`sampling.verify` accepts a prefix and
samples the bonus token.  The output is distributed exactly as the target's (greedy:
identical to :class:`ARDecoder`), because p and q go through the same
temperature / top-k / top-p transform and verify uses the very q the drafts were drawn from.

Bookkeeping.  ``seq`` is prompt + reply so far.  The target runner holds every token of
``seq`` but the last, which is fed at the start of the next verification.  The draft
(:mod:`drafting`: a model draft or a feature draft, behind one interface) holds some prefix
of ``seq`` and catches up before drafting.  Rollback after a round is truncation only;
accepted tokens are never recomputed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Generator, Iterator
from typing import Any

import torch

from . import forward
from .ar import context_budget, error_event
from .detok import ReplyBuilder
from .drafting import Choose, drafter, fit_vocab, vocab_size  # noqa: F401 - fit_vocab/vocab_size: SD's public helpers
from .errors import ParamError
from .events import Done, Event, Notice, Round, Token
from .metrics import Metrics
from .models import LoadedModel
from .params import SamplingParams
from .penalties import Penalties
from .sampling import greedy_outcome, logits_to_probs, make_generator, sample, verify


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


def plain_choice(params: SamplingParams, gen: torch.Generator, pen: Penalties | None = None) -> Choose:
    """SD's rule for drawing a draft token: q is the draft's distribution under the target's
    penalties / temperature / top-k / top-p (a point mass on the argmax under greedy).  The i-th
    draft token is penalized for the committed tokens plus the i drawn before it this round."""
    drawn: list[int] = []

    def choose(logits: torch.Tensor, i: int) -> tuple[int, torch.Tensor]:
        del drawn[i:]
        if pen is not None:
            logits = pen.rows(logits[None], drawn, i)[0]
        q = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # [V]
        tok = int(q.argmax()) if params.temperature == 0.0 else int(sample(q, gen))
        drawn.append(tok)
        return tok, q
    return choose


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
        tdev, ddev = self.target.device, self.draft.device
        budget = min(context_budget(self.target, len(prompt_ids), params), context_budget(self.draft, len(prompt_ids), params))
        builder = ReplyBuilder(self.target.tokenizer, self.target.eos_ids, params.stop, budget, params.ignore_eos)
        metrics = Metrics(self.mode)
        gen = make_generator(params.seed, tdev)
        # the draft samples with its own generator on its own device (a different stream of the same seed)
        dgen = gen if ddev == tdev else make_generator(None if params.seed is None else params.seed + 1, ddev)
        # the penalties' reply counts, on each model's device (the same tokens)
        tpen = Penalties.of(params, prompt_ids)
        dpen = tpen if ddev == tdev else Penalties.of(params, prompt_ids)
        choose = plain_choice(params, dgen, dpen)
        reason = None
        try:
            mode = self.engine.config.compile
            draft = drafter(self.draft.model, self._vocab, ddev, mode, (1, self.k + 1), self.draft.name)
            features = draft.reads_features  # the target's hidden states go to the draft
            target = forward.runner(self.target.model, "target", mode, (self.k + 1,), tdev, draft.mid_layer, self.target.name)
            # prefill: everything but the last prompt token, which the first round feeds
            seq = list(prompt_ids)
            if len(seq) > 1:
                draft.prefill(seq[:-1], target.append(seq[:-1], logits="last", hidden=features))
            metrics.prefill_s = time.perf_counter() - t0
            index = 0
            while True:
                for note in forward.take_notices(self.target.model, self.draft.model):  # on transformers, a failed compile
                    yield Notice(note, "info")
                if stop is not None and stop.is_set():
                    reason = "cancelled"
                    break
                # never draft past the budget: k drafts + 1 bonus <= remaining
                k = max(0, min(self.k, builder.remaining - 1))
                num_seq = len(seq)

                # draft: catch up on the tokens it has not seen, then propose k tokens from q
                t_draft = time.perf_counter()
                drafts, qs = draft.propose(seq, k, choose) if k else ([], [])
                draft_s = time.perf_counter() - t_draft

                # verify: one target forward over [last, d1..dk], then accept a prefix and sample the bonus
                t_verify = time.perf_counter()
                out = target.append([seq[-1], *drafts], hidden=features)  # logits [k+1, V]
                # row i follows seq + drafts[:i]: penalized for exactly that prefix, as AR would
                rows = tpen.rows(out.logits, drafts)
                if params.temperature == 0.0:  # point masses: one argmax decides (sampling.greedy_outcome)
                    num_accepted, bonus = greedy_outcome(rows, drafts)
                else:
                    p = logits_to_probs(rows, params.temperature, params.top_k, params.top_p)  # [k+1, V]
                    q = torch.stack(qs).to(tdev) if k else p[:0]  # [k, V]
                    num_accepted, bonus = verify(torch.tensor(drafts, dtype=torch.long, device=tdev), q, p, gen)
                # roll back: both keep [.., last, d1..dn]
                target.truncate(num_seq + num_accepted)
                draft.rollback(num_seq + num_accepted, out)
                verify_s = time.perf_counter() - t_verify

                # emit the accepted drafts and the bonus; EOS / stop / length end the reply at that token
                emitted, bonus_id = yield from emit_block(builder, metrics, drafts, num_accepted, bonus, t0)
                seq += [*drafts[:num_accepted], bonus]  # only read again if the reply goes on
                for pen in {id(tpen): tpen, id(dpen): dpen}.values():
                    pen.add([*drafts[:num_accepted], bonus])
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
        yield Done(reason, builder.text + builder.flush(), tuple(builder.token_ids), metrics.stats(time.perf_counter() - t0))
