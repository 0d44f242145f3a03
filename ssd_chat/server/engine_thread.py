"""The server's one engine thread: requests decode one at a time, in arrival order (batch 1).

HTTP handlers run on the asyncio event loop and must never wait on torch; they put a
:class:`Job` in a bounded FIFO queue and read its events back from an ``asyncio.Queue`` that
this thread fills with ``call_soon_threadsafe``.  A full queue refuses the job at once (429),
and a job whose client went away (its ``stop`` set) ends at the engine's next round, or is
skipped if it never started, so the next one begins right away.

Per-request modes (``"ssd_mode": "sd"``) decode with a sibling :class:`Engine` over the same
loaded target and draft, made once and kept.  ``Engine.reconfigure`` would switch the one
engine back and forth instead, but each switch closes the decoder, and for SSD that means
stopping the speculator process and starting (and loading) a new one for the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine import MODES, Engine, threads, ParamError, SSDChatError, prompt_logprobs, SamplingParams
from ..engine import Done, Error, Notice, Round, Stats, Token
from .metrics import ServerMetrics

log = logging.getLogger("ssd_chat.server")
END = None  # posted after a job's last event


@dataclass(frozen=True)
class PromptLogprobs:
    """Posted before an echo's reply: each prompt token's (logprob, top alternatives), None for the first."""

    values: list[Any]


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("queue full")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    pass


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    mode: str
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stop: threading.Event = field(default_factory=threading.Event)
    id: int = 0
    arrived_s: float = field(default_factory=time.perf_counter)
    # filled in by the engine thread, for the log line and the tests
    started_s: float | None = None
    ended_s: float | None = None
    reason: str | None = None
    num_tokens: int = 0
    rounds_after_stop: int = 0  # rounds decoded after the client went away (the engine stops at the next one)
    prompt_logprobs: int | None = None  # echo: the prompt tokens' logprobs first, with this many alternatives
    generate: bool = True  # False: the prompt's logprobs only (max_tokens 0)

    def post(self, item: Any) -> None:
        """Hand an event (or END, or an exception) to the request's handler; thread-safe."""
        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineWorker:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int = 16) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._engines: dict[str, Engine] = {engine.config.mode: engine}
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # orders submit() against drain()
        self._closing = False
        self._closed = False
        self.running: Job | None = None
        self.history: list[Job] = []  # finished jobs, oldest first (last 1000)
        self._recent_s: list[float] = []  # durations of the last replies, for Retry-After
        self._threads = threads.count()  # torch's thread count is per thread: the engine thread sets it
        # read when /metrics is asked, as /health reads them: the gauges cannot lag the queue
        metrics.follow(lambda: 1 if self.running is not None else 0, lambda: self.waiting)
        self._thread = threading.Thread(target=self._loop, name="ssd-engine", daemon=True)
        self._thread.start()

    # -- the event-loop side ---------------------------------------------------------------
    def modes(self) -> list[str]:
        """Modes a request may ask for: any that the loaded draft supports."""
        return [m for m in MODES if self._check_mode(m) is None]

    def _check_mode(self, mode: str) -> str | None:
        if mode not in MODES:
            return f"unknown ssd_mode '{mode}' (use one of {', '.join(MODES)})"
        if mode == self.engine.config.mode or mode in self._engines:
            return None
        if mode != "ar" and self.engine.draft is None:
            return f"ssd_mode '{mode}' needs a draft, and this server was started without one (start it with --mode {mode})"
        try:
            from ..engine import check_draft_for_mode

            check_draft_for_mode(mode, self.engine.draft)
        except ParamError as e:
            return str(e)
        return None

    def engine_for(self, mode: str) -> Engine:
        """The engine that decodes ``mode`` (raises ParamError if the loaded draft cannot)."""
        why = self._check_mode(mode)
        if why is not None:
            raise ParamError(why)
        if mode not in self._engines:
            e = self.engine
            self._engines[mode] = Engine(replace(e.config, mode=mode), e.target, e.draft)
        return self._engines[mode]

    def degraded(self) -> str | None:
        """Why a mode this server decodes is not running as itself (SSD's speculator given up on), or None."""
        for e in list(self._engines.values()):
            why = getattr(getattr(e, "_decoder", None), "disabled", None)
            if why:
                return why
        return None

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job) -> Job:
        """Queue ``job`` behind the others; QueueFull or ShuttingDown if it cannot be."""
        with self._lock:
            if self._closing:
                raise ShuttingDown()
            job.id = next(self._ids)
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self.metrics._l(self.metrics.rejected).inc()
                raise QueueFull(self._retry_after()) from None
        return job

    def _retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the recent mean reply time, at least 1."""
        mean = sum(self._recent_s) / len(self._recent_s) if self._recent_s else 1.0
        return max(1, math.ceil(mean))

    def drain(self) -> None:
        """Stop taking requests; queued ones get a shutdown error, the running one finishes."""
        with self._lock:
            self._closing = True
            while True:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job.reason = "shutdown"
                    job.post(ShuttingDown())

    def close(self, timeout_s: float = 30.0) -> None:
        """Drain, cancel the running reply if it is still going, end the thread, close every
        engine (which stops SSD's speculator process)."""
        if self._closed:
            return
        self._closed = True
        self.drain()
        running = self.running
        if running is not None:
            running.stop.set()
        self._queue.put(END)
        self._thread.join(timeout_s)
        for e in self._engines.values():
            with contextlib.suppress(Exception):
                e.close()

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        threads.worker(self._threads)
        while True:
            job = self._queue.get()
            if job is END:
                return
            if job.stop.is_set():  # the client left while it waited
                job.reason = "cancelled"
                self._finish(job)
                continue
            self.running = job
            self._decode(job)

    def _decode(self, job: Job) -> None:
        job.started_s = time.perf_counter()
        self.metrics.started(len(job.prompt_ids), job.started_s - job.arrived_s)
        try:
            engine = self.engine_for(job.mode)
            if job.prompt_logprobs is not None:
                cfg = engine.config
                rows = (1,) if cfg.mode == "ar" else (cfg.k + 1,)
                job.post(PromptLogprobs(prompt_logprobs(engine.target, job.prompt_ids, job.prompt_logprobs, cfg.compile, rows)))
            events = engine.stream(job.prompt_ids, job.params, job.stop) if job.generate else [self._nothing(job, engine)]
            for ev in events:
                if job.stop.is_set() and isinstance(ev, Round):
                    job.rounds_after_stop += 1
                if isinstance(ev, Token):
                    job.num_tokens += 1
                elif isinstance(ev, Done):
                    job.reason = ev.reason
                elif isinstance(ev, Error):
                    job.reason = "error"
                    log.error("request %d failed: %s", job.id, ev.message)
                elif isinstance(ev, Notice):
                    log.warning("request %d: %s", job.id, ev.message)
                self.metrics.observe(ev)
                job.post(ev)
                if isinstance(ev, Done):
                    self._log_done(job, ev)
        except Exception as e:  # noqa: BLE001 - a setup failure (e.g. the speculator) answers this request only
            job.reason = "error"
            msg = str(e) if isinstance(e, SSDChatError) else f"{type(e).__name__}: {e}"
            log.error("request %d failed: %s", job.id, msg)
            ev = Error(msg, "param" if isinstance(e, ParamError) else "runtime")
            self.metrics.observe(ev)
            job.post(ev)
        finally:
            job.ended_s = time.perf_counter()
            self.metrics.ended(job.ended_s - job.arrived_s)
            self._recent_s = (self._recent_s + [job.ended_s - job.started_s])[-8:]
            self.running = None
            self._finish(job)

    @staticmethod
    def _nothing(job: Job, engine: Engine) -> Done:
        """The end of a reply of no tokens (max_tokens 0: its prompt's logprobs were the answer)."""
        mode = engine.config.mode
        return Done("length", "", (), Stats(mode, 0, 0, time.perf_counter() - (job.started_s or 0.0), 0.0, None, None, None, None, None))

    def _finish(self, job: Job) -> None:
        self.history = (self.history + [job])[-1000:]
        job.post(END)

    def _log_done(self, job: Job, done: Done) -> None:
        s = done.stats
        parts = [f"request {job.id}: {s.mode}, {s.new_tokens} tokens, {done.reason}"]
        if s.tok_per_s is not None:
            parts.append(f"{s.tok_per_s:.1f} tok/s")
        if s.acceptance_rate is not None:
            parts.append(f"acceptance {s.acceptance_rate:.0%}")
        if s.cache_hit_rate is not None:
            parts.append(f"cache hits {s.cache_hit_rate:.0%}")
        log.info(", ".join(parts))
