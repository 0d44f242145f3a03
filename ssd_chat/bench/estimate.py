"""``bench --dry-run``'s estimate of a run's duration: a short timed probe of every configuration the plan
would race (a few decode steps on the planned models and placements), scaled by the plan's prompts x new
tokens x repeats.  Nothing of the race itself runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import BenchError
from .prompts import BenchPrompt
from .protocols import Plan
from .runner import BenchSettings, build_engines, close_all

PROBE_TOKENS = 8  # decode steps timed per configuration, after a 2-token warm-up of the same prompt


@dataclass
class Probe:
    mode: str
    where: str  # the plan's placement, as the dry run prints it
    prefill_s: float  # time to the first token
    per_token_s: float  # each later token
    run_s: float  # one reply of the plan's length


@dataclass
class Estimate:
    probes: list[Probe]
    load_s: float  # loading the models (the race loads them too)
    total_s: float
    runs: int  # replies the race would time (warm-ups not counted)
    max_new_tokens: int
    stops_at_eos: bool
    skipped: dict[str, str] = field(default_factory=dict)


def probe(base_config: Any, models_for: Callable[[Plan], tuple[Any, Any]], prompts: list[BenchPrompt], plans: list[Plan],
          settings: BenchSettings, load_s: float = 0.0, tokens: int = PROBE_TOKENS,
          encode: Callable[[Any, BenchPrompt], tuple[list[int], tuple[str, ...]]] | None = None) -> Estimate:
    """Time ``tokens`` decode steps of each distinct configuration on the race's warm-up prompt, pinned as the
    race pins it, and scale: per configuration its memory-bandwidth reading (timed here as the race does it),
    one warm-up reply and prompts x repeats replies of ``settings.max_new_tokens`` tokens each; plus ``load_s``."""
    from ..engine import messages_for, Done, Error
    from .machine import Pinning, read_bandwidth

    encode = encode or (lambda eng, p: eng.prompt_ids(messages_for(p.text)))
    skipped: dict[str, str] = {}
    engines: dict[tuple, Any] = {}
    pin = Pinning()
    out: list[Probe] = []
    per_slot = len(prompts) * settings.repeats
    total = load_s
    try:
        slots, engines = build_engines(base_config, models_for, plans, skipped, engines)
        for key, eng in engines.items():
            plan = slots[key]
            ids, extra_stop = encode(eng, prompts[0])
            pin.apply(plan.cores, plan.threads)
            t0 = time.perf_counter()
            read_bandwidth(plan.target_device)  # the race measures it once per configuration too
            total += time.perf_counter() - t0
            timed: tuple[float, int, float | None] = (0.0, 0, None)
            for n in (2, tokens):  # the first reply pays one-off costs (a compile, the speculator's start)
                s = settings.sampling  # the race's first repeat's seed
                params = replace(s, seed=1234 if s.seed is None else s.seed, max_new_tokens=n, stop=tuple(extra_stop), ignore_eos=True)
                t0 = time.perf_counter()
                for ev in eng.stream(ids, params):
                    if isinstance(ev, Error):
                        raise BenchError(f"{plan.mode} failed while probing: {ev.message}")
                    if isinstance(ev, Done):
                        timed = (time.perf_counter() - t0, ev.stats.new_tokens, ev.stats.ttft_s)
            elapsed, new, ttft = timed
            prefill = ttft if ttft is not None else elapsed / max(1, new)
            per_token = max(0.0, elapsed - prefill) / max(1, new - 1)
            run_s = prefill + per_token * (settings.max_new_tokens - 1)
            warm = prefill + per_token * (min(settings.warmup_tokens, settings.max_new_tokens) - 1)
            total += warm + per_slot * run_s
            out.append(Probe(plan.mode, plan.describe(), prefill, per_token, run_s))
    finally:
        close_all(engines, pin)
    return Estimate(out, load_s, total, per_slot * len(out), settings.max_new_tokens, not settings.sampling.ignore_eos, skipped)


def duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s} s"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h} h " if h else "") + f"{m} min" + (f" {s} s" if s and not h else "")


def render(est: Estimate, probe_tokens: int = PROBE_TOKENS) -> list[str]:
    """The dry run's estimate lines."""
    lines = [f"estimate: about {duration(est.total_s)} for {est.runs} timed replies of {est.max_new_tokens} tokens"
             + (" at most (replies that end at EOS take less)" if est.stops_at_eos else "")
             + f", from {probe_tokens} timed tokens of each configuration and {duration(est.load_s)} of loading:"]
    for p in est.probes:
        lines.append(f"  {p.mode.upper()}: {p.where}: first token {p.prefill_s * 1e3:.0f} ms, then "
                     f"{p.per_token_s * 1e3:.1f} ms a token, about {duration(p.run_s)} a reply")
    for mode, why in est.skipped.items():
        lines.append(f"  {mode.upper()}: would be skipped: {why}")
    return lines
