"""Speculative speculative decoding (SSD, Saguaro; Kumar, Dao & May, ICLR 2026): the verifier.

The target runs here, in the app process; the draft runs in a speculator process
(:mod:`speculator`) on its own device or CPU cores, behind :mod:`channel`.  Per round
(spec §2.2):

1. send the last outcome ``(k_prev, bonus)``; the speculator answers at once from its
   speculation cache (a hit) or from a fallback (a miss) with ``d_1..d_k`` and the q'
   they were drawn from;
2. verify ``[bonus, d_1..d_k]`` with one target forward and :func:`sampling.verify`,
   while the speculator predicts this round's outcomes and drafts k tokens for each;
3. commit the accepted tokens and the new bonus; repeat.

The output is exact: greedy SSD equals greedy AR token for token, and at temperature > 0
it is distributed as the target's, because every proposal comes with the distribution it
was sampled from (Saguaro-reshaped or a point mass) and verification is the one routine
in :mod:`sampling`.

If the speculator dies, raises or stays silent for ``speculator_timeout_s``, the reply
continues here with a :class:`Notice`: as plain SD with the in-process draft
(``engine.draft``), else as AR.  No speculator process outlives the app: it is a daemon
child that is closed by :meth:`SSDDecoder.close`, a finalizer at interpreter exit, and
(Linux) PR_SET_PDEATHSIG if the app is killed; it ignores SIGINT.

About the ``Round`` fields here: ``cache_hit``, ``fallback``, ``predicted`` and
``speculator_busy_s`` describe where *this round's* drafts came from: ``predicted`` is the
outcome set the speculator cached while the *previous* round was verified (its key is the
previous round's ``(accepted, bonus_id)``), and ``speculator_busy_s`` the glue + tree time
that built it.  ``wait_s`` is how long the verifier waited for this round's drafts;
``draft_s`` the fallback drafting on the critical path (0 on a hit).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import fanout, fastlinear, kv, workers
from .ar import context_budget, error_event
from .channel import Channel, Reply, Settings
from .detok import ReplyBuilder
from .errors import ParamError, SpeculatorError
from .events import Done, Event, Notice, Round, Token
from .metrics import Metrics
from .models import parse_placement
from .params import SamplingParams
from .sampling import logits_to_probs, make_generator, sample_next, verify
from .sd import emit_block
from .speculator import Speculator, recipe_for, worker_main

LOAD_TIMEOUT_S = 180.0  # the speculator's start (imports + loading the draft)
CLOSE_TIMEOUT_S = 3.0


def _vocab_size(model: torch.nn.Module) -> int:
    head = model.get_output_embeddings()
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor):
        return int(w.shape[0])
    if callable(w):  # dynamic-quantized Linear
        return int(w().shape[0])
    return int(model.config.vocab_size)


@dataclass(frozen=True)
class Plan:
    """Where the verifier and the speculator run."""

    draft_device: str
    draft_cores: tuple[int, ...] | None
    draft_threads: int | None
    target_cores: tuple[int, ...] | None
    target_threads: int | None
    shared: bool  # one device/core set for both (SSD still runs, with no real overlap)

    @property
    def label(self) -> str:
        d = self.draft_device + (f" (cores {','.join(map(str, self.draft_cores))})" if self.draft_cores else "")
        t = f"cores {','.join(map(str, self.target_cores))}" if self.target_cores else "as loaded"
        return f"speculator on {d}; verifier {t}"


def plan(config: Any, target_device: torch.device, target_cores: tuple[int, ...] | None) -> Plan:
    """Default placement: on CPU the draft gets the last half of the cores (core 1 of 2) and the
    target the rest (core 0); on GPUs the draft gets the last GPU.  Explicit devices win."""
    avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    dspec = (config.draft_device or "auto").strip().lower()
    if dspec == "auto":
        if target_device.type == "cuda":
            n = torch.cuda.device_count()
            dev = f"cuda:{n - 1}"
            return Plan(dev, None, None, target_cores, len(target_cores) if target_cores else None, n == 1)
        dspec = "cpu"
    dplace = parse_placement(dspec, "auto")
    if dplace.device.type != "cpu":
        shared = target_device == dplace.device
        return Plan(str(dplace.device), None, None, target_cores, len(target_cores) if target_cores else None, shared)
    dcores = dplace.cores
    if target_device.type != "cpu":
        return Plan("cpu", dcores, len(dcores) if dcores else None, target_cores, None, False)
    if dcores is None:
        if len(avail) < 2:
            return Plan("cpu", None, 1, None, None, True)
        pool = [c for c in avail if not target_cores or c not in target_cores] or avail
        dcores = tuple(pool[len(pool) - max(1, len(pool) // 2) if not target_cores else 0:])
    if target_cores is None:
        target_cores = tuple(c for c in avail if c not in dcores) or tuple(avail)
    shared = bool(set(target_cores) & set(dcores))
    return Plan("cpu", dcores, len(dcores), target_cores, len(target_cores), shared)


@contextlib.contextmanager
def _pinned(cores: tuple[int, ...] | None, threads: int | None) -> Iterator[None]:
    """Pin the calling thread to ``cores`` and torch to ``threads`` threads; restore after."""
    old_aff = os.sched_getaffinity(0) if cores and hasattr(os, "sched_setaffinity") else None
    if old_aff is not None and old_aff == set(cores):  # already there (moving a thread costs ~ms)
        old_aff = None
    old_threads = torch.get_num_threads()
    try:
        if old_aff is not None:
            os.sched_setaffinity(0, cores)
        if threads:
            torch.set_num_threads(threads)
            fastlinear.prepare()  # the few-row choices for this thread count (stored after the first time)
        yield
    finally:
        if old_aff is not None:
            os.sched_setaffinity(0, old_aff)
        torch.set_num_threads(old_threads)


class _Worker:
    """A running speculator process and its channel."""

    def __init__(self, decoder: "SSDDecoder") -> None:
        e = decoder.engine
        ctx = workers.context()
        parent, child = ctx.Pipe(duplex=True)
        qbuf = torch.zeros(decoder.k, decoder.vocab, dtype=torch.float32).share_memory_()
        src = e.target if e.draft.spec.kind == "derived" else e.draft
        recipe = recipe_for(e.draft, e.target, decoder.plan.draft_device, src.placement.dtype)
        fan = fanout.parse(e.config.fan_out, decoder.k, e.config.budget, decoder.vocab)
        self.proc = ctx.Process(
            target=worker_main, name="ssd-speculator", daemon=True,
            args=(child, recipe, decoder.k, fan, e.config.fallback, decoder.vocab, qbuf, decoder.plan.draft_cores,
                  decoder.plan.draft_threads, os.getpid(), decoder.fault),
        )
        workers.start(self.proc)  # works under Textual too (its stderr has no fd)
        child.close()
        self.channel = Channel(parent, qbuf, self.proc.sentinel)
        self.ready = False
        self.pid = self.proc.pid
        self._finalizer = weakref.finalize(self, _shutdown, self.proc, parent)

    def wait_ready(self, timeout: float) -> None:
        if not self.ready:
            msg = self.channel.recv(timeout)
            if not (isinstance(msg, tuple) and msg[0] == "ready"):
                raise SpeculatorError(f"unexpected first message from the speculator: {msg!r}")
            self.ready = True

    def close(self) -> None:
        self._finalizer()


def _shutdown(proc: Any, conn: Any) -> None:
    """Ask the speculator to exit; terminate, then kill it if it does not.  Idempotent."""
    with contextlib.suppress(Exception):
        conn.send(("close",))
    proc.join(CLOSE_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(CLOSE_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join(CLOSE_TIMEOUT_S)
    with contextlib.suppress(Exception):
        conn.close()


class SSDDecoder:
    mode = "ssd"
    fault: str | None = None  # test hook passed to the worker: "raise:N", "sleep:N:S", "exit:N"
    max_restarts = 2

    def __init__(self, engine: Any, start: bool = True) -> None:
        if engine.draft is None:
            raise ParamError("SSD needs a draft model (--draft copy|int8|layers:N|MODEL)")
        from .engine import check_draft_for_mode

        check_draft_for_mode("ssd", engine.draft)
        self.engine = engine
        self.k: int = engine.config.k
        self.vocab = _vocab_size(engine.target.model)
        fanout.parse(engine.config.fan_out, self.k, engine.config.budget, self.vocab)  # bad flags fail here
        self.plan = plan(engine.config, engine.target.device, engine.target.placement.cores)
        self._worker: _Worker | None = None
        self._local: Speculator | None = None
        self._restarts = 0
        self._last_error: str | None = None
        self._told_shared = False
        if start:
            self._start()
            if self._worker is not None and self.plan.target_threads:
                with _pinned(self.plan.target_cores, self.plan.target_threads):
                    pass  # times the target's few-row linears for the thread count it will decode with, now rather than in the first reply

    # -- the worker's lifecycle -----------------------------------------------------------
    def _start(self) -> None:
        try:
            self._worker = _Worker(self)
        except Exception as e:  # noqa: BLE001 - e.g. a draft that cannot be shipped
            self._worker, self._last_error = None, f"{type(e).__name__}: {e}"

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def _drop_worker(self, why: str) -> None:
        self._last_error = why
        if self._worker is not None:
            self._worker.close()
            self._worker = None

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
        return self._worker.channel.ping()

    # -- decoding -------------------------------------------------------------------------
    def stream(self, prompt_ids: list[int], params: SamplingParams, stop: threading.Event | None = None) -> Iterator[Event]:
        cfg, target = self.engine.config, self.engine.target
        tmodel, tdev, k = target.model, target.device, self.k
        budget = context_budget(target, len(prompt_ids), params, lookahead=k + 1)
        builder = ReplyBuilder(target.tokenizer, target.eos_ids, params.stop, budget, params.ignore_eos)
        metrics = Metrics(self.mode)
        gen = make_generator(params.seed, tdev)
        settings = Settings(params.temperature, params.top_k, params.top_p, params.seed, cfg.saguaro_c)
        timeout = cfg.speculator_timeout_s
        reason = None
        sd_rounds_s = 0.0  # what SD would have spent on the same rounds: verify + k draft steps (estimate)
        # the speculator: the worker (restarted after a failure in an earlier reply), else in-process
        if self._worker is None and self._restarts < self.max_restarts and self._last_error is not None:
            self._restarts += 1
            self._start()
        if self._worker is not None:
            try:  # a one-time start (imports, loading the draft): not part of this reply's timings
                self._worker.wait_ready(LOAD_TIMEOUT_S)
            except SpeculatorError as e:
                self._drop_worker(str(e))
        t0 = time.perf_counter()
        if self._worker is None:
            yield self._switch(metrics, f"SSD speculator unavailable ({self._last_error}); {self._local_mode_name()} in this process", 0)
        elif self.plan.shared and not self._told_shared:
            self._told_shared = True
            yield Notice("SSD: verifier and speculator share one device, so they cannot overlap", "info")
        pin = self.plan if self._worker is not None else None
        stack = contextlib.ExitStack()
        if pin is not None:
            stack.enter_context(_pinned(pin.target_cores, pin.target_threads))
        try:
            with stack:
                remote = self._worker
                if remote is not None:
                    try:
                        remote.channel.send(("begin", list(prompt_ids), settings))  # draft prefill overlaps ours
                    except SpeculatorError as e:
                        self._drop_worker(str(e))
                        remote = None
                        stack.close()
                        yield self._switch(metrics, f"{e}; {self._local_mode_name()} in this process", 0)
                # prefill; the target samples the first token (spec §2.8)
                tcache = kv.new_cache(tmodel)
                logits = kv.forward(tmodel, torch.tensor(prompt_ids, device=tdev), tcache, last_only=True)[-1]
                metrics.prefill_s = time.perf_counter() - t0
                pending = sample_next(logits, params.temperature, params.top_k, params.top_p, gen)
                seq = list(prompt_ids)  # tokens with target KV; `pending` has none yet
                delta = builder.push(pending)
                if builder.reason != "eos":
                    ev = Token(pending, delta, "target", time.perf_counter() - t0)
                    metrics.add(ev)
                    yield ev
                local = None if remote is not None else self._begin_local(seq, settings)
                k_prev, verify_s, index = -1, 0.0, 0
                while not builder.finished:
                    if stop is not None and stop.is_set():
                        reason = "cancelled"
                        break
                    # 1. the speculation for this round
                    t_wait = time.perf_counter()
                    reply: Reply | None = None
                    q: torch.Tensor | None = None
                    if remote is not None:
                        try:
                            reply = remote.channel.request(k_prev, pending, verify_s, timeout, stop)
                            if reply is None:  # cancelled while waiting
                                reason = "cancelled"
                                break
                            q = remote.channel.q_rows(reply)
                        except SpeculatorError as e:
                            self._drop_worker(str(e))
                            remote, reply = None, None
                            stack.close()  # unpin: the verifier has the machine to itself now
                            yield self._switch(metrics, f"{e}; continuing {self._local_mode_name()} in this process", index)
                            local = self._begin_local(seq, settings)
                            k_prev = -1
                    if reply is None and local is not None:
                        reply, q = local.serve(index, k_prev, pending)
                    wait_s = time.perf_counter() - t_wait
                    drafts = list(reply.tokens) if reply is not None else []

                    # 2. verify [pending, d_1..d_k] with one target forward
                    t_verify = time.perf_counter()
                    logits = kv.forward(tmodel, torch.tensor([pending, *drafts], device=tdev), tcache)  # [k+1, V]
                    p = logits_to_probs(logits, params.temperature, params.top_k, params.top_p)  # [k+1, V]
                    d = torch.tensor(drafts, dtype=torch.long, device=tdev)
                    qm = q.to(tdev) if q is not None else torch.nn.functional.one_hot(d, p.shape[-1]).float()  # [k, V]
                    n, bonus = verify(d, qm, p, gen)
                    kv.truncate(tcache, len(seq) + 1 + n)  # keep [.., pending, d_1..d_n]
                    verify_s = time.perf_counter() - t_verify

                    # 3. commit: accepted drafts, then the bonus; EOS / stop / length end the reply there
                    seq += [pending, *drafts[:n]]
                    emitted, bonus_id = yield from emit_block(builder, metrics, drafts, n, bonus, t0)
                    if reply is not None:
                        rnd = self._round(index, reply, n, bonus_id, emitted, wait_s, verify_s, t0, remote is not None)
                        sd_rounds_s += verify_s + (k * reply.step_s if remote is not None else rnd.draft_s)
                        metrics.add(rnd)
                        yield rnd
                    k_prev, pending, index = n, bonus, index + 1
                if reason is None:
                    reason = builder.reason
        except Exception as e:  # noqa: BLE001 - reported as an event, with the partial reply
            yield error_event(e, builder)
            return
        if metrics.num_rounds:
            metrics.sd_estimate_s = (metrics.t_first or metrics.prefill_s) + sd_rounds_s
        yield Done(reason, builder.text + builder.flush(), tuple(builder.token_ids), metrics.stats(time.perf_counter() - t0))

    def _round(self, index: int, r: Reply, n: int, bonus_id: int | None, emitted: int, wait_s: float, verify_s: float,
               t0: float, is_remote: bool) -> Round:
        if is_remote:
            return Round(index, r.tokens, n, bonus_id, emitted, r.fallback_s, verify_s, time.perf_counter() - t0,
                         cache_hit=r.hit, predicted=r.predicted, wait_s=wait_s, speculator_busy_s=r.build_s, fallback=r.fallback)
        # in-process SD after a failure: drafting is all on the critical path
        return Round(index, r.tokens, n, bonus_id, emitted, wait_s, verify_s, time.perf_counter() - t0)

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

    def _begin_local(self, seq: list[int], settings: Settings) -> Speculator | None:
        """Plain SD from here: the in-process draft, no cache (neural fallback every round)."""
        if not self._has_local_draft():
            return None
        if self._local is None:
            self._local = Speculator(self.engine.draft.model, self.k, None, "neural", vocab=self.vocab)
        self._local.begin(seq, settings)
        return self._local
