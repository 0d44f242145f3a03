"""The live comparison: one prompt answered greedily in AR, SD and SSD one after another on the
same loaded models, with each mode's decode rate and whether the three outputs are identical
(they must be: SD and SSD are exact).  ``ssd-chat compare "..."`` and the app's Ctrl+G share it.

One measured run per mode, each after a short warm-up run of the same prompt in that mode
(the first forward passes compile kernels and time matrix products, and SSD starts its
speculator process: without it, whichever mode ran first would look slow).  It is a
demonstration, not a benchmark: ``ssd-chat bench`` interleaves modes and repeats.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .engine.events import Done, Error, Event, Notice
from .tui.figures import ran_as

MODES = ("ar", "sd", "ssd")
DEFAULT_MAX_NEW_TOKENS = 64  # three runs of this on 2 CPU cores take tens of seconds, not minutes
WARMUP_TOKENS = 4


@dataclass
class Run:
    mode: str  # the mode asked for
    done: Done | None = None
    error: str | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def ran_as(self) -> str | None:
        return ran_as(self.done.stats) if self.done is not None else None

    @property
    def tok_per_s(self) -> float | None:
        return self.done.stats.tok_per_s if self.done is not None else None


@dataclass
class Comparison:
    runs: list[Run]

    @property
    def finished(self) -> list[Run]:
        return [r for r in self.runs if r.done is not None and r.done.reason in ("eos", "stop", "length")]

    @property
    def identical(self) -> bool | None:
        """Whether every finished run produced the same tokens (None with fewer than two)."""
        runs = self.finished
        if len(runs) < 2:
            return None
        return all(r.done.token_ids == runs[0].done.token_ids for r in runs[1:])

    def speedup(self, mode: str, over: str) -> float | None:
        a, b = self.by_mode(mode), self.by_mode(over)
        if a is None or b is None or not a.tok_per_s or not b.tok_per_s or a.ran_as != mode or b.ran_as != over:
            return None
        return a.tok_per_s / b.tok_per_s

    def by_mode(self, mode: str) -> Run | None:
        return next((r for r in self.runs if r.mode == mode), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "runs": [{
                "mode": r.mode, "ran_as": r.ran_as, "error": r.error, "notices": r.notices,
                "finish_reason": r.done.reason if r.done else None,
                "text": r.done.text if r.done else None,
                "token_ids": list(r.done.token_ids) if r.done else None,
                "new_tokens": r.done.stats.new_tokens if r.done else None,
                "tok_per_s": r.tok_per_s, "ttft_s": r.done.stats.ttft_s if r.done else None,
                "mean_accepted_length": r.done.stats.mean_accepted_length if r.done else None,
                "cache_hit_rate": r.done.stats.cache_hit_rate if r.done else None,
            } for r in self.runs],
            "speedups": {f"{a}/{b}": self.speedup(a, b) for a, b in (("sd", "ar"), ("ssd", "ar"), ("ssd", "sd"))},
        }


def run(reconfigure: Callable[[str], None], stream: Callable[[int | None], Iterator[Event]], current_mode: str,
        modes: tuple[str, ...] = MODES, on_run: Callable[[Run], None] | None = None,
        stop: threading.Event | None = None, warmup_tokens: int = WARMUP_TOKENS) -> Comparison:
    """Run ``stream(max_new_tokens)`` (the same greedy prompt; None: the full length) once per mode after a
    warm-up of ``warmup_tokens``, switching with ``reconfigure(mode)``; the engine is back in ``current_mode``
    afterwards, whatever happened.  ``on_run`` hears each run as it ends."""
    runs: list[Run] = []
    try:
        for mode in modes:
            if stop is not None and stop.is_set():
                break
            r = Run(mode)
            runs.append(r)
            try:
                reconfigure(mode)
                if warmup_tokens:
                    for _ in stream(warmup_tokens):
                        pass
                for ev in stream(None):
                    if isinstance(ev, Done):
                        r.done = ev
                    elif isinstance(ev, Error):
                        r.error = ev.message
                    elif isinstance(ev, Notice):
                        r.notices.append(ev.message)
            except Exception as e:  # noqa: BLE001 - one mode failing does not end the comparison
                r.error = str(e) or type(e).__name__
            if on_run is not None:
                on_run(r)
    finally:
        reconfigure(current_mode)
    return Comparison(runs)


def run_line(r: Run) -> str:
    """One run as a line: mode, tokens, tok/s, TTFT, accepted length, cache hits."""
    if r.done is None:
        return f"{r.mode.upper():<4} failed: {r.error or 'no reply'}"
    s = r.done.stats
    label = r.mode.upper() + (f" (ran as {r.ran_as.upper()})" if r.ran_as != r.mode else "")
    parts = [f"{label:<4}", f"{s.new_tokens:>4} token{'' if s.new_tokens == 1 else 's'}",
             f"{s.tok_per_s:6.1f} tok/s" if s.tok_per_s is not None else "   n/a tok/s",
             f"TTFT {s.ttft_s:.2f} s" if s.ttft_s is not None else "TTFT n/a"]
    if s.mean_accepted_length is not None:
        parts.append(f"τ {s.mean_accepted_length:.2f}")
    if s.cache_hit_rate is not None:
        parts.append(f"cache hits {s.cache_hit_rate:.0%}")
    return "  ".join(parts)


def summary(c: Comparison) -> str:
    """The verdict line: identical or not, and the measured speedups on this prompt."""
    same = c.identical
    if same is None:
        verdict = "outputs: fewer than two runs finished, nothing to compare"
    elif same:
        n = len(c.finished[0].done.token_ids)
        verdict = f"outputs: identical ({n} token{'' if n == 1 else 's'}, greedy) ✓"
    else:
        verdict = "outputs: DIFFERENT — greedy SD and SSD must equal AR; please report this"
    ups = [f"{a.upper()}/{b.upper()} {v:.2f}×" for a, b in (("ssd", "ar"), ("ssd", "sd"), ("sd", "ar"))
           if (v := c.speedup(a, b)) is not None]
    return verdict + ("; measured on this prompt: " + ", ".join(ups) if ups else "")
