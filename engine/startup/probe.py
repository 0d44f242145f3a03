"""``--mode auto``'s measured choice: time AR, SD and SSD on this machine with the loaded models, keep the
fastest, and remember it (:mod:`probe_store`: the key, the records, the lock, the machine's load).

The probe runs the real decoders (greedy, one fixed chat prompt, :data:`TOKENS` new tokens with EOS
ignored): one short warm-up each, then :data:`REPEATS` runs interleaved (AR SD SSD AR SD SSD ...), so
a machine that gets busier part-way slows every mode alike; each mode's figure is its median decode
rate, explained by the same runs' mean accepted length and a verification's cost in AR steps.

A speculative mode is chosen only when it beat AR by more than :data:`MARGIN` (noise is not a reason
to run a draft), and only from a trusted record: figures that cannot be right (:func:`noisy`) or runs
that other work shared the cores with (``Load.busy``) are kept as such, and ``auto`` runs AR on them.

Who measures (:func:`settle`'s ``measure``): ``"now"`` (``ssd-chat config measure`` and the background
measurer), ``"background"`` (the app and ``serve``: with no record they run AR and start a measurer
process at the lowest priority, ``ssd_chat.chat.measure``), ``"no"`` (``ask`` and the rest: the
record, else AR).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field, TypeAdapter, ValidationError

from ..config import EngineConfig
from . import probe_store as ps
from .probe_store import FILE, key_fields  # noqa: F401 - where callers and tests find them

PROMPT = "Explain in a few sentences how a bicycle works."
TOKENS = 24  # new tokens per timed run
WARMUP_TOKENS = 6
REPEATS = 3
MARGIN = 0.05  # a speculative mode must beat AR by more than this to be chosen
STAGE = "measuring {} on this machine"


def listed(modes: tuple[str, ...]) -> str:
    """("ar", "sd", "ssd") -> "AR, SD and SSD"."""
    up = [m.upper() for m in modes]
    return up[0] if len(up) == 1 else f"{', '.join(up[:-1])} and {up[-1]}"
VERSION = 1  # of a result's format


@dataclass(frozen=True)
class Sample:
    """One timed run of one mode."""

    tok_s: float  # decode rate (Stats.tok_per_s)
    accepted: float | None = None  # tokens per verification, bonus included (SD, SSD)
    verify_s: float | None = None  # median verification time (SD, SSD)
    hit_rate: float | None = None  # SSD: speculation cache hits per round
    failed: str | None = None  # the mode did not run as itself (e.g. SSD without its speculator)


class Probed(Protocol):
    """What the probe needs of an :class:`engine.Engine`, which calls it (so it imports no engine)."""

    config: EngineConfig
    target: Any  # the loaded target (its device)
    measure_later: tuple[EngineConfig, int] | None

    def prompt_ids(self, messages: list[dict[str, str]]) -> tuple[list[int], tuple[str, ...]]: ...

    def new_decoder(self, mode: str) -> Any: ...

    def settle(self, mode: str, reason: str, decoder: Any = None) -> None: ...


Run = Callable[[Any, list[int], Any], Sample]  # (decoder, prompt ids, params) -> Sample


def run_decoder(decoder: Any, prompt_ids: list[int], params: Any) -> Sample:
    """Decode once with ``decoder`` and read its figures from its events."""
    from ..events import Done, Error, Round

    verify: list[float] = []
    done = None
    for ev in decoder.stream(prompt_ids, params):
        if isinstance(ev, Round):
            verify.append(ev.verify_s)
        elif isinstance(ev, Error):
            return Sample(0.0, failed=ev.message)
        elif isinstance(ev, Done):
            done = ev
    if done is None or not done.stats.tok_per_s:
        return Sample(0.0, failed="no decode rate")
    s = done.stats
    if s.ran_as and s.ran_as != s.mode:
        return Sample(0.0, failed=f"ran as {s.ran_as.upper()}")
    return Sample(s.tok_per_s, s.mean_accepted_length, statistics.median(verify) if verify else None, s.cache_hit_rate)


# -- the result ------------------------------------------------------------------------------------
Figures = dict[str, Annotated[float, Field(ge=0, allow_inf_nan=False)]]


@dataclass(frozen=True)
class Result:
    tok_s: Figures  # median decode rate per mode that ran
    k: int
    accepted: Figures  # SD / SSD: tokens per verification
    verify_steps: Figures  # SD / SSD: a verification's time in AR steps (1 / AR's rate)
    hit_rate: float | None = None  # SSD
    failed: dict[str, str] | None = None  # modes that did not run, and why

    def to_json(self) -> dict[str, Any]:
        return {"v": VERSION, **_STORED.dump_python(self, mode="json")}

    @classmethod
    def from_json(cls, d: Any) -> "Result | None":
        """A stored result, or None for anything malformed."""
        if not isinstance(d, dict) or d.get("v") != VERSION:
            return None
        try:
            r = _STORED.validate_python(d)
        except ValidationError:
            return None
        return r if r.tok_s.get("ar") else None


_STORED = TypeAdapter(Result)


def floor(engine: Any) -> float:
    """The fewest AR steps a (k+1)-row verify can cost on the target's device: on a CPU at least one (it
    reads every weight, as a 1-row step does, and on no more threads than AR's); a GPU's wide units
    leave room for timing noise."""
    return 1.0 if engine.target.device.type == "cpu" else 0.5


def noisy(r: Result, least: float = 0.5) -> str | None:
    """Why ``r`` cannot be right, or None: a verify cheaper than ``least`` AR steps means the AR runs
    were slowed by other work on the machine (the figure would flatter SD and SSD)."""
    low = {m: v for m, v in r.verify_steps.items() if v < least}
    if not low:
        return None
    m, v = min(low.items(), key=lambda x: x[1])
    return (f"{m.upper()}'s {r.k + 1}-row verify timed at {v:.1f} AR steps, cheaper than a 1-row step"
            + (" can be on this device" if least < 1 else "") + ": other work slowed AR")


def choose(r: Result, margin: float = MARGIN) -> str:
    """The fastest mode measured, AR unless a speculative mode beat it by more than ``margin``."""
    best = "ar"
    for m in ("sd", "ssd"):
        rate = r.tok_s.get(m)
        if rate and rate > r.tok_s["ar"] * (1 + margin) and rate > r.tok_s.get(best, 0.0):
            best = m
    return best


def reason(r: Result, mode: str, margin: float = MARGIN) -> str:
    """One line: the choice, every mode's figure, and why the best speculative mode pays or does not."""
    figures = ", ".join(f"{m.upper()} {r.tok_s[m]:.1f}" for m in ("ar", "sd", "ssd") if m in r.tok_s)
    line = f"{mode.upper()}: measured fastest here ({figures} tok/s)"
    spec = [m for m in ("ssd", "sd") if m in r.tok_s]
    m = mode if mode != "ar" else max(spec, key=lambda x: r.tok_s[x], default=None)
    if m is not None:
        ratio = r.tok_s[m] / r.tok_s["ar"]
        why = [f"a {r.k + 1}-row verify costs {r.verify_steps[m]:.1f} AR steps"] if m in r.verify_steps else []
        if m in r.accepted:
            why.append(f"{r.accepted[m]:.1f} tokens per verify")
        if m == "ssd" and r.hit_rate is not None:
            why.append(f"{r.hit_rate:.0%} cache hits")
        noise = f", within the {margin:.0%} noise margin" if mode == "ar" and ratio > 1 else ""
        line += f"; {m.upper()} {ratio:.2f}x AR{noise}" + (f": {', '.join(why)}" if why else "")
    for m, why_failed in (r.failed or {}).items():
        line += f"; {m.upper()} did not run ({_short(why_failed)})"
    return line


CANNOT_PAY = ("; on this CPU a verify costs too much of an AR step for the tokens it accepts, so speculation cannot pay "
              "here: `ssd-chat bench --simulate h100-70b-1b` shows SSD winning where it can (a 70B target, a 1B draft, GPUs)")
REMEASURE = "`ssd-chat config measure` measures again"


def _short(text: str, limit: int = 100) -> str:
    first = " ".join(str(text).split())
    return first if len(first) <= limit else first[:limit - 1] + "…"


# -- measuring ---------------------------------------------------------------------------------------
def measure(engine: Probed, modes: tuple[str, ...], progress: Callable[[str, float | None], None], run: Run | None = None,
            repeats: int = REPEATS, tokens: int = TOKENS, decoders: dict[str, Any] | None = None) -> Result:
    """Time ``modes`` (AR first) with the engine's models; ``decoders`` receives the decoders it makes
    (the caller keeps the chosen one and closes the rest)."""
    from ..params import SamplingParams

    stage = STAGE.format(listed(modes))
    progress(stage, 0.0)
    prompt = engine.prompt_ids([{"role": "user", "content": PROMPT}])[0]
    warm = SamplingParams(temperature=0.0, max_new_tokens=WARMUP_TOKENS, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True)
    decoders = {} if decoders is None else decoders
    run = run or run_decoder
    samples: dict[str, list[Sample]] = {m: [] for m in modes}
    failed: dict[str, str] = {}
    steps, done, rep = len(modes) * (repeats + 1), 0, 0
    while rep <= repeats:  # round 0: the warm-up, not counted
        for m in modes:
            if m not in failed:
                try:
                    if m not in decoders:
                        decoders[m] = engine.new_decoder(m)
                    s = run(decoders[m], prompt, warm if rep == 0 else params)
                except Exception as e:  # noqa: BLE001 - a mode that cannot run here is not chosen
                    s = Sample(0.0, failed=f"{type(e).__name__}: {e}")
                if s.failed:
                    failed[m] = s.failed
                elif rep:
                    samples[m].append(s)
            done += 1
            progress(stage, done / steps)
        if rep == 0 and _waited_for_graphs(engine, lambda busy: progress(f"{stage}: waiting for its graphs: {busy}", None)):
            steps += len(modes)  # the warm-up again, on the graphs the timed runs will take
            continue
        rep += 1
    if "ar" in failed:
        from ..errors import SSDChatError

        raise SSDChatError(f"the mode probe could not run AR: {failed['ar']}")
    med = {m: statistics.median(s.tok_s for s in ss) for m, ss in samples.items() if ss}
    step_s = 1.0 / med["ar"]

    def median_of(m: str, attr: str) -> float | None:
        got = [getattr(s, attr) for s in samples.get(m, []) if getattr(s, attr) is not None]
        return statistics.median(got) if got else None

    accepted = {m: a for m in ("sd", "ssd") if m in med and (a := median_of(m, "accepted")) is not None}
    verify = {m: v / step_s for m in ("sd", "ssd") if m in med and (v := median_of(m, "verify_s")) is not None}
    return Result(med, engine.config.k, accepted, verify, median_of("ssd", "hit_rate"), failed or None)


def _waited_for_graphs(engine: Probed, say: Callable[[str], None]) -> bool:
    """A warm-up can start a background build of the target's graphs (``--compile auto`` on a first start):
    timing eager replies beside it would compare paths, not modes, on a core the build holds."""
    forwards = getattr(engine.target, "forwards", None)
    return bool(forwards is not None and forwards.wait_for_builds(say))


# -- the choice a record makes ---------------------------------------------------------------------
def choice(rec: ps.Record, on_cpu: bool) -> tuple[str, str]:
    """(mode, the *why* line) from a stored record: a speculative mode only from a trusted one."""
    r = Result.from_json(rec.result)
    if r is None:
        return "ar", f"AR: the stored measurement cannot be read; {REMEASURE}"
    if rec.verdict != "ok":
        figures = ", ".join(f"{m.upper()} {r.tok_s[m]:.1f}" for m in ("ar", "sd", "ssd") if m in r.tok_s)
        return "ar", f"AR: the measurement ({figures} tok/s) was not trusted: {rec.why}; {REMEASURE}"
    mode = choose(r)
    return mode, reason(r, mode) + (CANNOT_PAY if on_cpu and mode == "ar" and len(r.tok_s) > 1 else "")


def record(result: Result, load: ps.Load, least: float) -> ps.Record:
    """The verdict on one measurement: noisy figures first, then a busy machine, else ok."""
    import time

    why = noisy(result, least)
    if why is None and load.busy():
        why = f"measured while the machine was busy ({load.words()})"
        return ps.Record(result.to_json(), "busy", why, time.time(), load)
    return ps.Record(result.to_json(), "noisy" if why else "ok", why, time.time(), load)


# -- settle: the engine gets auto's mode ---------------------------------------------------------------
def settle(engine: Probed, draft: str | None, modes: tuple[str, ...], progress: Callable[[str, float | None], None],
           measure: str = "no", source: EngineConfig | None = None, run: Run | None = None,
           path: Path | None = None) -> ps.Record | None:
    """Give ``engine`` auto's mode for this key: the stored record's, else (``measure="now"``) measured now
    and stored, else AR (``"background"``: sets ``engine.measure_later`` to ``source`` and the key's lock, for
    which the caller starts a low-priority measurer, :func:`start_measurer`, once its own load is done).
    Returns the record used, if any."""
    fields = ps.key_fields(engine.config, draft)
    on_cpu = engine.target.device.type == "cpu"
    rec = None if measure == "now" else ps.read(fields, path)
    if rec is None and measure == "now":
        return _measure_now(engine, fields, modes, progress, run, path, on_cpu)
    if rec is not None:
        engine.settle(*choice(rec, on_cpu))
        if measure == "background" and rec.stale():
            engine.measure_later = _later(source or engine.config, fields, path)
        return rec
    what = listed(modes)
    later = _later(source or engine.config, fields, path) if measure == "background" else None
    if measure == "background" and later is None:
        engine.settle("ar", f"AR for now: another ssd-chat is measuring {what} on this machine; the next start uses the fastest")
    elif measure == "background":
        engine.measure_later = later
        engine.settle("ar", f"AR for now: measuring {what} in the background at low priority; the next start uses the fastest")
    else:
        engine.settle("ar", f"AR: {what} not measured on this machine yet (the app and `serve` measure them in the "
                            "background; `ssd-chat config measure` now)")
    return None


def _measure_now(engine: Probed, fields: dict[str, Any], modes: tuple[str, ...], progress: Callable[[str, float | None], None],
                 run: Run | None, path: Path | None, on_cpu: bool) -> ps.Record | None:
    from ..errors import SSDChatError

    with ps.lock(fields, path, wait=1.0) as mine:
        if not mine:
            raise SSDChatError(f"another ssd-chat is measuring {listed(modes)} for this setup now; "
                               "`ssd-chat config` shows its result when it is done")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        watch = ps.Watch(cores if on_cpu else 1)
        decoders: dict[str, Any] = {}
        try:
            result = measure(engine, modes, progress, run, decoders=decoders)
        except BaseException as e:
            for d in decoders.values():
                getattr(d, "close", lambda: None)()
            if not isinstance(e, Exception):
                raise
            engine.settle("ar", f"AR: measuring the modes failed ({_short(f'{type(e).__name__}: {e}')})")
            return None
        rec = record(result, watch.stop(), floor(engine))
        ps.write(fields, rec, path)
    mode, why = choice(rec, on_cpu)
    for m, d in decoders.items():
        if m != mode:  # no speculator outlives a probe that did not choose SSD
            getattr(d, "close", lambda: None)()
    engine.settle(mode, why, decoders.get(mode))
    return rec


def _later(config: EngineConfig, fields: dict[str, Any], path: Path | None) -> tuple[EngineConfig, int] | None:
    """(what to measure, the key's lock, taken now so that no other start measures it meanwhile), or None:
    another process holds it."""
    fd = ps.take(fields, path)
    return None if fd is None else (config, fd)


def start_measurer(later: tuple[EngineConfig, int]) -> subprocess.Popen | None:
    """A process that measures the modes at the lowest priority and stores the record, dying with this one
    (``ssd_chat.chat.measure``); it inherits the key's lock.  None if it cannot start."""
    import json

    from ..processes import popen

    config, fd = later
    try:
        return popen([sys.executable, "-m", "ssd_chat.chat.measure", str(os.getpid()), json.dumps(asdict(config), default=str)],
                     {ps.LOCK_FD: str(fd)} if fd >= 0 else {}, (fd,) if fd >= 0 else ())
    except OSError:
        return None
    finally:
        if fd >= 0:
            os.close(fd)  # the child's copy holds the lock now


def in_config(pre: Any) -> tuple[str | None, str, ps.Record | None]:
    """What ``ssd-chat config`` says a :class:`preflight.Preflight` resolves to, without loading: for a
    probed ``auto``, the stored record's choice (and the record: when, under what load), else ``None``."""
    if not pre.probe:
        return pre.config.mode, pre.reason, None
    fields = ps.key_fields(pre.config, pre.draft)
    rec = ps.read(fields)
    if rec is None and ps.measuring(fields):
        return None, f"AR for now: another ssd-chat is measuring {listed(pre.probe)} on this machine ({pre.reason})", None
    if rec is None:
        return None, (f"{listed(pre.probe)} not measured on this machine yet: the app and `serve` measure them in the "
                      f"background at their first start, `ssd-chat config measure` now ({pre.reason})"), None
    from ..load.models import parse_placement

    on_cpu = parse_placement(pre.config.target_device, pre.config.dtype).device.type == "cpu"
    return (*choice(rec, on_cpu), rec)
