"""The live comparison: one prompt answered greedily in AR, SD and SSD on the same loaded models,
interleaved and repeated (AR, SD, SSD, AR, SD, SSD, ...), with each mode's decode rate, the median
and spread of each speedup over the repeats, its physical bound, and whether every output is
identical (they must be: SD and SSD are exact).  ``ssd-chat compare "..."`` and the app's Ctrl+G share it.

Each run follows a short warm-up run of the same prompt in its mode (the first forward passes
compile kernels and time matrix products, and SSD starts its speculator process: without it,
whichever mode ran first would look slow).  Interleaving spreads a busy spell on the machine over
all modes instead of one; a speedup above its physical bound (:mod:`ssd_chat.engine.metrics`) is
still timing noise and is said to be.  ``ssd-chat bench`` is the fuller measurement.
"""

from __future__ import annotations

import statistics
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine import MODES, Done, Error, Event, Notice, over_ar_bound, ssd_over_sd_bound
from .stats import ran_as

RATIOS = (("ssd", "ar"), ("ssd", "sd"), ("sd", "ar"))
DEFAULT_MAX_NEW_TOKENS = 64  # nine runs of this on 2 CPU cores take a minute or two
DEFAULT_REPEATS = 3
WARMUP_TOKENS = 4


@dataclass
class Run:
    mode: str  # the mode asked for
    repeat: int = 1  # 1-based
    done: Done | None = None
    error: str | None = None
    notices: list[str] = field(default_factory=list)

    @property
    def ran_as(self) -> str | None:
        return ran_as(self.done.stats) if self.done is not None else None

    @property
    def tok_per_s(self) -> float | None:
        return self.done.stats.tok_per_s if self.done is not None else None


@dataclass(frozen=True)
class Ratio:
    """tok/s(a) / tok/s(b) over the repeats where both ran (each pair back to back), and its bound."""

    values: tuple[float, ...]
    bound: float | None

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def noise(self) -> bool:
        return self.bound is not None and self.median > self.bound

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": min(self.values), "max": max(self.values), "n": len(self.values),
                "bound": self.bound, "above_bound": self.noise}


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

    @property
    def repeats(self) -> int:
        return max((r.repeat for r in self.runs), default=0)

    def of(self, mode: str) -> list[Run]:
        """The finished runs of ``mode`` that ran as that mode, in order."""
        return [r for r in self.finished if r.mode == mode and r.ran_as == mode and r.tok_per_s]

    def median_tok_per_s(self, mode: str) -> float | None:
        xs = [r.tok_per_s for r in self.of(mode)]
        return statistics.median(xs) if xs else None

    def bound(self, mode: str, over: str) -> float | None:
        """The physical bound on ``mode``/``over`` (one rule with the bench's, :mod:`ssd_chat.engine.metrics`)."""
        if over == "ar":
            taus = [r.done.stats.mean_accepted_length for r in self.of(mode) if r.done.stats.mean_accepted_length]
            return over_ar_bound(max(taus)) if taus else None
        sd = [r.done.stats for r in self.of("sd")]
        if not sd or any(s.verify_s is None for s in sd):
            return None
        return ssd_over_sd_bound(sum(s.draft_s or 0.0 for s in sd), sum(s.verify_s for s in sd))

    def ratio(self, mode: str, over: str) -> Ratio | None:
        b = {r.repeat: r.tok_per_s for r in self.of(over)}
        xs = tuple(r.tok_per_s / b[r.repeat] for r in self.of(mode) if b.get(r.repeat))
        return Ratio(xs, self.bound(mode, over)) if xs else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "identical": self.identical,
            "repeats": self.repeats,
            "runs": [{
                "mode": r.mode, "repeat": r.repeat, "ran_as": r.ran_as, "error": r.error, "notices": r.notices,
                "finish_reason": r.done.reason if r.done else None,
                "text": r.done.text if r.done else None,
                "token_ids": list(r.done.token_ids) if r.done else None,
                "new_tokens": r.done.stats.new_tokens if r.done else None,
                "tok_per_s": r.tok_per_s, "ttft_s": r.done.stats.ttft_s if r.done else None,
                "mean_accepted_length": r.done.stats.mean_accepted_length if r.done else None,
                "cache_hit_rate": r.done.stats.cache_hit_rate if r.done else None,
            } for r in self.runs],
            "speedups": {f"{a}/{b}": (x.to_dict() if (x := self.ratio(a, b)) else None) for a, b in RATIOS},
        }


def run(reconfigure: Callable[[str], None], stream: Callable[[int | None], Iterator[Event]], current_mode: str,
        modes: tuple[str, ...] = MODES, on_run: Callable[[Run], None] | None = None,
        stop: threading.Event | None = None, warmup_tokens: int = WARMUP_TOKENS, repeats: int = DEFAULT_REPEATS) -> Comparison:
    """Run ``stream(max_new_tokens)`` (the same greedy prompt; None: the full length) in each mode in turn,
    ``repeats`` times over (AR, SD, SSD, AR, SD, SSD, ...), each run after a warm-up of ``warmup_tokens``,
    switching with ``reconfigure(mode)``; the engine is back in ``current_mode`` afterwards, whatever
    happened.  ``on_run`` hears each run as it ends."""
    runs: list[Run] = []
    try:
        for rep in range(1, repeats + 1):
            for mode in modes:
                if stop is not None and stop.is_set():
                    return Comparison(runs)
                r = Run(mode, rep)
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
    """One run as a line: mode, tokens, tok/s, TTFT, accepted length, cache hits, which repeat."""
    if r.done is None:
        return f"{r.mode.upper():<4} failed: {r.error or 'no reply'} (run {r.repeat})"
    s = r.done.stats
    label = r.mode.upper() + (f" (ran as {r.ran_as.upper()})" if r.ran_as != r.mode else "")
    parts = [f"{label:<4}", f"{s.new_tokens:>4} token{'' if s.new_tokens == 1 else 's'}",
             f"{s.tok_per_s:6.1f} tok/s" if s.tok_per_s is not None else "   n/a tok/s",
             f"TTFT {s.ttft_s:.2f} s" if s.ttft_s is not None else "TTFT n/a"]
    if s.mean_accepted_length is not None:
        parts.append(f"τ {s.mean_accepted_length:.2f}")
    if s.cache_hit_rate is not None:
        parts.append(f"cache hits {s.cache_hit_rate:.0%}")
    return "  ".join(parts + [f"(run {r.repeat})"])


def summary(c: Comparison) -> str:
    """The verdict (identical or not) and, on a line of its own, the speedups measured on this prompt:
    median over the repeats, min–max, and the physical bound; one above its bound is called noise."""
    same = c.identical
    if same is None:
        verdict = "outputs: fewer than two runs finished, nothing to compare"
    elif same:
        n = len(c.finished[0].done.token_ids)
        verdict = f"outputs: identical ({n} token{'' if n == 1 else 's'}, greedy, {len(c.finished)} runs) ✓"
    else:
        verdict = "outputs: DIFFERENT — greedy SD and SSD must equal AR; please report this"
    ups = []
    for a, b in RATIOS:
        x = c.ratio(a, b)
        if x is None:
            continue
        spread = f"{min(x.values):.2f}–{max(x.values):.2f}" if len(x.values) > 1 else "one run"
        tail = (f"; above the bound {x.bound:.2f}×: noise, not a speedup" if x.noise
                else f"; bound {x.bound:.2f}×" if x.bound is not None else "")
        ups.append(f"{a.upper()}/{b.upper()} {x.median:.2f}× ({spread}{tail})")
    if not ups:
        return verdict
    noisy = any(x.noise for a, b in RATIOS if (x := c.ratio(a, b)) is not None)
    return (verdict + f"\nmeasured on this prompt, median of {c.repeats} interleaved repeat{'' if c.repeats == 1 else 's'} "
            "(min–max; physical bound): " + ", ".join(ups)
            + ("\na ratio above its physical bound means the machine was busy during some runs: rerun, or use `ssd-chat bench`"
               if noisy else ""))
