"""Speculative speculative decoding (SSD, Saguaro; Kumar, Dao & May, ICLR 2026): the verifier.

The target runs here, in the app process; the draft runs in a speculator process on its own device
or CPU cores, behind :mod:`channel`.  One round, :meth:`SSDDecoder._round` (spec §2.2):

1. take the drafts ``d_1..d_k`` (and the q' they were drawn from) that the speculator served for
   the last outcome ``(k_prev, bonus)``: from its speculation cache (a hit) or a fallback (a miss);
2. verify ``[bonus, d_1..d_k]`` with one target forward and :func:`outcome.sampled` (one read),
   while the speculator predicts this round's outcomes and drafts k tokens for each;
3. send the outcome at once, so the next round's drafts are served while this round's
   accepted tokens and bonus are committed; repeat.

The output is exact (greedy SSD equals greedy AR token for token; at temperature > 0 it is
distributed as the target's), because every proposal comes with the distribution it was sampled
from (Saguaro-reshaped or a point mass) and verification is SD's routine.

If the speculator dies, raises or stays silent for ``speculator_timeout_s``, the reply continues
here with a :class:`Notice`: as plain SD with the in-process draft, else as AR.  No speculator
process outlives the app (:mod:`processes`).

``Round`` fields here describe where *this round's* drafts came from: ``predicted`` is the outcome
set the speculator cached while the *previous* round was verified, ``speculator_busy_s`` the glue +
tree time that built it, ``wait_s`` how long the verifier waited for the drafts, and ``draft_s`` the
fallback drafting on the critical path (0 on a hit).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from .. import threads
from ..cpu import fastlinear
from ..drafts.drafter import vocab_size
from ..drafts.shipped import check_draft_for_mode
from ..errors import ParamError, SpeculatorError
from ..events import Event, Notice, Round
from ..load.models import LoadedModel
from ..metrics import Metrics
from ..model import forward, runner as kv
from ..params import SamplingParams
from .. import fanout
from ..speculate.channel import Begin
from ..speculate.plan import Plan, plan  # noqa: F401 - Plan and plan: SSD's placement, public here
from ..speculate.proposers import LocalProposer, NoProposer, Proposer, RemoteProposer
from ..speculate.process import recipe_for
from .decoder import Decoder, Noticing, ReplyFrame, context_budget, emit_block
from .detok import ReplyBuilder
from ..sampling.penalties import Penalties
from . import outcome
from ..sampling.sampling import logits_to_probs, make_generator, sample_next

LOAD_TIMEOUT_S = 180.0  # the speculator's start (imports + loading the draft)


@dataclass
class _VerifierState:
    """One reply's verifier state: what the round reads and advances."""

    target: kv.ModelRunner  # holds every token of `seq`; `pending` has no KV yet
    builder: ReplyBuilder
    metrics: Metrics
    params: SamplingParams
    gen: torch.Generator
    t0: float
    stop: threading.Event | None
    seq: list[int]
    pending: int  # the last bonus token
    pen: Penalties  # counts the reply's tokens in `seq` (not `pending`)
    verify_s: float = 0.0  # the last verification's time (the speculator's --fallback auto reads it)
    index: int = 0
    sd_s: float = 0.0  # what SD would have spent on the same rounds: verify + k draft steps (estimate)


class SSDDecoder(Decoder):
    mode = "ssd"
    fault: str | None = None  # test hook passed to the worker: "raise:N", "sleep:N:S", "exit:N"
    max_restarts = 2

    def __init__(self, engine: Any, start: bool = True) -> None:
        if engine.draft is None:
            raise ParamError("SSD needs a draft model (--draft copy|int8|layers:N|MODEL)")
        check_draft_for_mode("ssd", engine.draft)
        self.engine = engine
        self.k: int = engine.config.k
        self.vocab = vocab_size(engine.target.model)
        fanout.parse(engine.config.fan_out, self.k, engine.config.budget, self.vocab)  # bad flags fail here
        self.plan = plan(engine.config, engine.target.device, engine.target.placement.cores)
        self._worker: RemoteProposer | None = None
        self._restarts = 0
        self._last_error: str | None = None
        self._told_shared = False
        if start:
            self._start()
            if self._worker is not None and self.plan.target_threads:
                # the target's few-row products for the thread count it decodes with, now rather than in the first reply
                fastlinear.prepare(self.plan.target_threads)

    # -- the worker's lifecycle -----------------------------------------------------------
    def _start(self) -> None:
        e = self.engine
        try:
            src = e.target if e.draft.spec.kind == "derived" else e.draft
            recipe = recipe_for(e.draft, e.target, self.plan.draft_device, src.placement.dtype)
            fan = fanout.parse(e.config.fan_out, self.k, e.config.budget, self.vocab)
            self._worker = RemoteProposer(recipe, self.k, fan, e.config.fallback, self.vocab, self.plan.draft_cores,
                                          self.plan.draft_threads, e.config.speculator_timeout_s, self.fault, e.config.compile,
                                          spin=not self.plan.shared)
        except Exception as ex:  # noqa: BLE001 - e.g. a draft that cannot be shipped
            self._worker, self._last_error = None, f"{type(ex).__name__}: {ex}"

    @property
    def disabled(self) -> str | None:
        """Why SSD is given up on (the speculator failed with no restart left), or None."""
        if self._worker is None and self._last_error is not None and self._restarts >= self.max_restarts:
            return f"the SSD speculator failed {self._restarts + 1} times in a row ({self._last_error}); replies run {self._local_mode_name()}"
        return None

    @property
    def speculator_forward(self) -> str | None:
        """What forwards the draft in the speculator process, as it reported once loaded (None before)."""
        return self._worker.forward if self._worker is not None else None

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def _drop_worker(self, why: str) -> None:
        self._last_error = why
        self.close()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def ping(self) -> float:
        """Channel round trip to the speculator, seconds (starts it if needed)."""
        if self._worker is None:
            self._start()
        assert self._worker is not None
        self._worker.wait_ready(LOAD_TIMEOUT_S)
        return self._worker.ping()

    @property
    def target(self) -> LoadedModel:
        return self.engine.target

    def _prepare(self) -> None:
        """Readies the speculator process for a reply: restarted after a failure in an earlier reply and loaded
        before the reply's clock starts.  ``max_restarts`` bounds *consecutive* failures (a speculator
        that cannot work at all); a reply it serves to the end resets the count, so failures that one
        request caused, between working replies, never disable SSD."""
        if self._worker is None and self._restarts < self.max_restarts and self._last_error is not None:
            self._restarts += 1
            self._start()
        if self._worker is not None:
            try:
                self._worker.wait_ready(LOAD_TIMEOUT_S)
            except SpeculatorError as e:
                self._drop_worker(str(e))

    # -- decoding -------------------------------------------------------------------------
    def _budget(self, num_prompt: int, params: SamplingParams) -> int:
        return context_budget(self.target, num_prompt, params, lookahead=self.k + 1)

    def _noticed(self) -> tuple[Noticing, ...]:
        sources: list[Noticing] = [self.target.forwards]
        if self.engine.draft is not None:  # the in-process fallback's
            sources.append(self.engine.draft.forwards)
        if self._worker is not None:  # what the speculator said at its start
            sources.append(self._worker)
        return tuple(sources)

    def _reply(self, prompt_ids: list[int], r: ReplyFrame) -> Generator[Event, None, None]:
        cfg, params, metrics = self.engine.config, r.params, r.metrics
        begin = Begin(tuple(prompt_ids), params, cfg.saguaro_c, len(prompt_ids))
        spec: Proposer | None = self._worker  # readied by _prepare
        if spec is None:
            yield self._switch(metrics, f"SSD speculator unavailable ({self._last_error}); {self._local_mode_name()} in this process", 0)
        elif self.plan.shared and not self._told_shared:
            self._told_shared = True
            yield Notice("SSD: verifier and speculator share one device, so they cannot overlap", "info")
        target = self.engine.target
        runner = target.forwards.runner("target", cfg.compile, (self.k + 1,), target.device)
        # the prompt first, on the threads AR computes with (every core, as AR's prefill) when no other
        # process holds one: on the verifier's one core it was most of the TTFT, and the speculator has
        # nothing to draft before the first token
        with contextlib.nullcontext() if threads.free_for(torch.get_num_threads()) else threads.pinned(self.plan.target_cores, self.plan.target_threads):
            forward.feed(runner, prompt_ids)
        with contextlib.ExitStack() as pins:
            if spec is not None:
                pins.enter_context(threads.pinned(self.plan.target_cores, self.plan.target_threads))
                try:
                    spec.begin(begin)  # the draft's prefill overlaps the last row and the first token
                except SpeculatorError as e:
                    self._drop_worker(str(e))
                    spec = None
                    pins.close()
                    yield self._switch(metrics, f"{e}; {self._local_mode_name()} in this process", 0)
            st = yield from self._prefill(prompt_ids, r, runner)
            if spec is None:
                spec = self._local(st.seq, begin)
            spec.request(-1, st.pending, 0.0)  # the first round's drafts
            while (yield from r.go_on()):
                try:
                    if not (yield from self._round(st, spec)):
                        r.cancelled = True  # while waiting for the drafts
                        break
                except SpeculatorError as e:
                    self._drop_worker(str(e))
                    pins.close()  # unpin: the verifier has the machine to itself now
                    yield self._switch(metrics, f"{e}; continuing {self._local_mode_name()} in this process", st.index)
                    spec = self._local(st.seq, begin)
                    spec.request(-1, st.pending)
            if isinstance(spec, RemoteProposer):  # it served this reply: earlier failures were not its own
                self._restarts = 0
        if metrics.num_rounds:
            metrics.sd_estimate_s = (metrics.t_first or metrics.prefill_s) + st.sd_s

    def _prefill(self, prompt_ids: list[int], r: ReplyFrame, runner: kv.ModelRunner) -> Generator[Event, None, _VerifierState]:
        """The end of the target's prefill (``runner`` has been fed all but the last prompt token,
        :func:`forward.feed`); it samples the first token itself (spec §2.8)."""
        target, params, builder, metrics = self.engine.target, r.params, r.builder, r.metrics
        gen = make_generator(params.seed, target.device)
        logits = forward.last(runner, prompt_ids)
        metrics.prefill_s = time.perf_counter() - r.t0
        pen = Penalties.of(params, prompt_ids)
        pending = sample_next(pen.apply(logits), params.temperature, params.top_k, params.top_p, gen)
        yield from emit_block(builder, metrics, [], 0, pending, r.t0, logits[None], params.logprobs)
        return _VerifierState(runner, builder, metrics, params, gen, r.t0, r.stop, list(prompt_ids), pending, pen)

    def _round(self, st: _VerifierState, spec: Proposer) -> Generator[Event, None, bool]:
        """One SSD round: the drafts for the last outcome, one target forward over [bonus, d_1..d_k],
        the acceptance test, commit, events.  Returns False if cancelled while waiting for the drafts."""
        # 1. the speculation for this round: answered from the cache built while the last round was verified
        t_wait = time.perf_counter()
        prop = spec.drafts(st.stop)
        if prop is None:
            return False
        wait_s = time.perf_counter() - t_wait
        drafts = list(prop.tokens)

        # 2. verify [pending, d_1..d_k] with one target forward and the one acceptance routine
        t_verify = time.perf_counter()
        logits = st.target.append([st.pending, *drafts]).logits  # [k+1, V]
        # row i follows seq + [pending, d_1..d_i]: penalized for exactly that prefix, as AR would
        rows = st.pen.rows(logits, [st.pending, *drafts], 1)
        d = torch.tensor(drafts, dtype=torch.long, device=rows.device)
        if st.params.temperature == 0.0 and prop.q is None:
            n_t, bonus_t = outcome.greedy(rows, d)
        else:
            p = logits_to_probs(rows, st.params.temperature, st.params.top_k, st.params.top_p)
            q = prop.q.to(p.device) if prop.q is not None else F.one_hot(d, p.shape[-1]).float()  # [k, V]; point masses
            n_t, bonus_t = outcome.sampled(d, q, p, st.gen)
        _, n, bonus = outcome.decided(d[:0], n_t, bonus_t)  # the round's one device read
        st.verify_s = time.perf_counter() - t_verify

        # 3. the outcome goes out first: the speculator serves the next round while this one commits
        spec.request(n, bonus, st.verify_s)
        st.target.truncate(len(st.seq) + 1 + n)  # keep [.., pending, d_1..d_n]
        # accepted drafts, then the bonus; EOS / stop / length end the reply there
        st.seq += [st.pending, *drafts[:n]]
        st.pen.add([st.pending, *drafts[:n]])
        emitted, bonus_id = yield from emit_block(st.builder, st.metrics, drafts, n, bonus, st.t0, logits, st.params.logprobs)
        if drafts:  # without a draft the round was a plain target step (AR after a failure): no Round
            rnd = Round(st.index, prop.tokens, n, bonus_id, emitted, prop.draft_s, st.verify_s,
                        time.perf_counter() - st.t0, **prop.round_fields(wait_s))
            st.sd_s += st.verify_s + prop.sd_draft_s
            st.metrics.add(rnd)
            yield rnd
        st.pending, st.index = bonus, st.index + 1
        return True

    # -- the in-process continuation ------------------------------------------------------------
    def _switch(self, metrics: Metrics, message: str, after_round: int) -> Notice:
        """The notice that the reply goes on without the speculator, counted in the reply's stats."""
        ev = Notice(message, "warning", mode="sd" if self._has_local_draft() else "ar", after_round=after_round)
        metrics.add(ev)
        return ev

    def _local_mode_name(self) -> str:
        return "as SD with the in-process draft" if self._has_local_draft() else "as AR"

    def _has_local_draft(self) -> bool:
        return self.engine.draft is not None and self.engine.draft.model is not None

    def _local(self, seq: list[int], begin: Begin) -> LocalProposer | NoProposer:
        """Drafts from this process from here on: plain SD with the in-process draft, else none (AR)."""
        d = self.engine.draft
        spec = LocalProposer(d.forwards, self.k, self.vocab, d.device, self.engine.config.compile) if self._has_local_draft() else NoProposer()
        spec.begin(replace(begin, prompt_ids=tuple(seq)))
        return spec
