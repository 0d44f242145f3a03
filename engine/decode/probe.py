"""``--mode auto``'s measured choice: time AR, SD and SSD on this machine with the loaded models, keep the
fastest, and remember it.

The probe runs the real decoders (greedy, one fixed chat prompt, :data:`TOKENS` new tokens with EOS
ignored): one short warm-up each (JIT, the speculator's start), then :data:`REPEATS` runs interleaved
(AR SD SSD AR SD SSD ...), so a machine that gets busier part-way slows every mode alike; each mode's
figure is its median decode rate.  What explains the result comes from the same runs: tokens per
verification (the mean accepted length) and a verification's cost in AR steps.

A speculative mode is chosen only when it beat AR by more than :data:`MARGIN` (noise is not a reason
to run a draft).  Results live in ``mode-probe.json`` in the cache dir, one entry per :func:`key_fields`
(this machine's CPU, cores and GPUs, torch and ssd-chat versions, the target file, the draft, k, dtype,
compile, placement, ``SSD_CHAT_CPU_KERNELS``): any change measures again.  An unreadable or corrupt
file means measuring again; an unwritable one, measuring at every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field, TypeAdapter, ValidationError

from ..config import EngineConfig, cache_dir
from ..config import cpu_name as _cpu_name  # a seam: tests give it another CPU

FILE = "mode-probe.json"
PROMPT = "Explain in a few sentences how a bicycle works."
TOKENS = 24  # new tokens per timed run
WARMUP_TOKENS = 6
REPEATS = 3
MARGIN = 0.05  # a speculative mode must beat AR by more than this to be chosen
STAGE = "measuring {} on this machine (once)"


def listed(modes: tuple[str, ...]) -> str:
    """("ar", "sd", "ssd") -> "AR, SD and SSD"."""
    up = [m.upper() for m in modes]
    return up[0] if len(up) == 1 else f"{', '.join(up[:-1])} and {up[-1]}"
VERSION = 1  # of the stored result's format


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


# a verify of k + 1 rows timed below this many AR steps: AR was slowed by other work (a quiet 2-core
# machine gives about 0.8: the verifier is pinned to one core, AR's step runs on two contending threads)
NOISY_VERIFY = 0.5


def noisy(r: Result) -> str | None:
    """Why ``r`` cannot be right, or None: a verify at a fraction of a one-row step means the AR runs
    were slowed by other work on the machine (the figure would flatter SD and SSD)."""
    low = {m: v for m, v in r.verify_steps.items() if v < NOISY_VERIFY}
    if not low:
        return None
    m, v = min(low.items(), key=lambda x: x[1])
    return f"a {r.k + 1}-row verify timed at {v:.1f} AR steps: other work slowed AR"


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


def _short(text: str, limit: int = 100) -> str:
    first = " ".join(str(text).split())
    return first if len(first) <= limit else first[:limit - 1] + "…"


# -- the cache -------------------------------------------------------------------------------------
def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _file_identity(path: Path) -> list[Any]:
    """A local model's path with its size and mtime (a folder: its files' total size and latest mtime)."""
    try:
        files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
        stats = [p.stat() for p in files]
        return [str(path.resolve()), sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)]
    except OSError:
        return [str(path)]


def _model_identity(name: str) -> list[Any]:
    from ..errors import ModelError
    from ..load import models

    try:
        spec = models.resolve(name)
    except (ModelError, OSError, ValueError):  # a derived draft ("int8", "layers:6", "trained"): the name is all there is
        return [name]
    if spec.kind in ("folder", "gguf"):
        return [spec.kind, *_file_identity(Path(spec.source))]
    return [spec.kind, spec.source]


def key_fields(config: EngineConfig, draft: str | None) -> dict[str, Any]:
    """Everything that can change which mode is fastest here."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "cpu": _cpu_name(), "cores": cores, "gpus": gpus, "torch": _version("torch"), "ssd-chat": _version("ssd-chat"),
        "target": _model_identity(config.target), "draft": _model_identity(draft) if draft else None, "k": config.k,
        "dtype": config.dtype, "compile": config.compile, "target_device": config.target_device,
        "draft_device": config.draft_device, "fan_out": config.fan_out, "budget": config.budget,
        "cpu_kernels": os.environ.get("SSD_CHAT_CPU_KERNELS", ""),
    }


def _key(fields: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def store_path() -> Path:
    return cache_dir() / FILE


def _read(path: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    return got if isinstance(got, dict) else {}


def cached(fields: dict[str, Any], path: Path | None = None) -> Result | None:
    entry = _read(path or store_path()).get(_key(fields))
    return Result.from_json(entry.get("result")) if isinstance(entry, dict) else None


def store(fields: dict[str, Any], result: Result, path: Path | None = None) -> None:
    """Add ``result`` under ``fields``; a cache dir that cannot be written is left as it is."""
    path = path or store_path()
    data = _read(path)
    data[_key(fields)] = {"key": fields, "result": result.to_json()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True, default=str), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def cached_choice(config: EngineConfig, draft: str | None, path: Path | None = None) -> tuple[str, str] | None:
    """(mode, reason) from an earlier probe of exactly this setup, or None (the next start measures)."""
    r = cached(key_fields(config, draft), path)
    if r is None:
        return None
    mode = choose(r)
    return mode, reason(r, mode)


def in_config(pre: Any) -> tuple[str | None, str]:
    """What ``ssd-chat config`` says a :class:`preflight.Preflight` resolves to, without loading: for a probed
    ``auto``, the cached choice, else ``None`` and that the first start measures."""
    if not pre.probe:
        return pre.config.mode, pre.reason
    return cached_choice(pre.config, pre.draft) or (
        None, f"the first start measures {listed(pre.probe)} on this machine and keeps the fastest ({pre.reason})")


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
    steps, done = len(modes) * (repeats + 1), 0
    for rep in range(repeats + 1):  # round 0: the warm-up, not counted
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


def settle(engine: Probed, draft: str | None, modes: tuple[str, ...], progress: Callable[[str, float | None], None],
           run: Run | None = None, path: Path | None = None) -> Result | None:
    """Give ``engine`` auto's measured mode: from the cache for this setup, else measured now and stored
    (None: measuring failed, and the engine runs AR, the one mode that needs nothing else)."""
    fields = key_fields(engine.config, draft)
    result = cached(fields, path)
    if result is not None and noisy(result):
        result = None  # measured on a busy machine: measure again
    decoders: dict[str, Any] = {}
    if result is None:
        try:
            result = measure(engine, modes, progress, run, decoders=decoders)
        except BaseException as e:
            for d in decoders.values():
                getattr(d, "close", lambda: None)()
            if not isinstance(e, Exception):
                raise
            engine.settle("ar", f"AR: measuring the modes failed ({_short(f'{type(e).__name__}: {e}')})")
            return None
        why = noisy(result)
        if why:  # not stored, and no speculative mode chosen on figures that cannot hold
            for d in decoders.values():
                getattr(d, "close", lambda: None)()
            engine.settle("ar", f"AR: the measurement was noisy ({why}); measured again at the next start")
            return result
        store(fields, result, path)
    mode = choose(result)
    for m, d in decoders.items():
        if m != mode:  # no speculator outlives a probe that did not choose SSD
            getattr(d, "close", lambda: None)()
    engine.settle(mode, reason(result, mode), decoders.get(mode))
    return result
