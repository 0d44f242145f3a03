"""Loading the models once and racing the plans: warm-up, then every prompt under every configuration,
interleaved, each reply tallied by the engine's own :class:`~ssd_chat.engine.metrics.Metrics`."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from . import BenchError
from .machine import Pinning, descendants_cpu_s, read_bandwidth, weight_bytes
from .prompts import BenchPrompt
from .protocols import Plan, cores_text
from ..engine import SamplingParams

DEFAULT_MAX_NEW = 128


@dataclass
class BenchSettings:
    modes: tuple[str, ...]
    protocols: tuple[str, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW
    repeats: int = 1
    warmup_tokens: int = 16
    sampling: SamplingParams = SamplingParams(ignore_eos=True)  # each run's, with its own seed (if unset), length and stops


@dataclass
class BenchRun:
    """Everything measured in one bench invocation."""

    runs: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, tuple[int, ...]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    channel_rtt_ms: float | None = None
    weight_bytes: int | None = None  # the target's weights: what a batch-1 forward reads from memory
    bandwidth: dict[str, float] = field(default_factory=dict)  # slot id -> bytes/s read with that slot's placement


def run_bench(base_config: Any, models_for: Callable[[Plan], tuple[Any, Any]], prompts: list[BenchPrompt], plans: list[Plan],
              settings: BenchSettings, encode: Callable[[Any, BenchPrompt], tuple[list[int], tuple[str, ...]]] | None = None,
              progress: Callable[[str], None] = lambda s: None) -> BenchRun:
    """Warm up, then run every prompt under every distinct plan, interleaved.

    ``models_for(plan) -> (target, draft)`` gives loaded models (shared between plans);
    ``encode(engine, prompt) -> (ids, extra_stop)`` defaults to the chat template."""
    from ..engine import messages_for, Done, Error, Notice, Round, Metrics

    encode = encode or (lambda eng, p: eng.prompt_ids(messages_for(p.text)))
    out = BenchRun()
    engines: dict[tuple, Any] = {}
    pin = Pinning()
    try:
        slots, engines = build_engines(base_config, models_for, plans, out.skipped, engines)
        encoded = {p.id: encode(next(iter(engines.values())), p) for p in prompts}
        keys = list(engines)

        def one(key: tuple, prompt: BenchPrompt, repeat: int, max_new: int, order: int) -> dict[str, Any]:
            plan, eng = slots[key], engines[key]
            ids, extra_stop = encoded[prompt.id]
            s = settings.sampling
            params = replace(s, seed=1234 + repeat if s.seed is None else s.seed, max_new_tokens=max_new, stop=tuple(extra_stop))
            pin.apply(plan.cores, plan.threads)
            tp = eng.target.forwards.sharded  # a tensor-parallel target's own processes are not background work
            ranks = frozenset(tp.pids if tp is not None else ())
            bg0 = descendants_cpu_s(ranks) if plan.mode != "ssd" else None
            rec: dict[str, Any] = {
                "run_id": f"{plan.slot_id}|{prompt.id}|{repeat}", "slot": plan.slot_id, "mode": plan.mode, "prompt_id": prompt.id,
                "family": prompt.family, "repeat": repeat, "order": order, "prompt_tokens": len(ids), "new_tokens": 0,
                "tok_per_s": None, "ttft_s": None, "elapsed_s": 0.0, "prefill_s": None, "reason": None, "error": None,
                "background_cpu_s": None, "notices": [],
                # what the report splits further than the engine's tally: rounds by cache hit, the speculator's side
                "wait_on_hit_s": 0.0, "verify_on_hit_s": 0.0, "speculator_busy_s": 0.0, "fallback_rounds": 0,
            }
            tally = Metrics(plan.mode)
            t0 = time.perf_counter()
            token_ids: list[int] = []
            for ev in eng.stream(ids, params):
                tally.add(ev)
                if isinstance(ev, Round):
                    rec["speculator_busy_s"] += ev.speculator_busy_s or 0.0
                    rec["fallback_rounds"] += ev.fallback is not None
                    if ev.cache_hit:
                        rec["wait_on_hit_s"] += ev.wait_s or 0.0
                        rec["verify_on_hit_s"] += ev.verify_s
                elif isinstance(ev, Done):
                    s = ev.stats
                    token_ids = list(ev.token_ids)
                    rec.update(new_tokens=s.new_tokens, tok_per_s=s.tok_per_s, ttft_s=s.ttft_s, prefill_s=s.prefill_s,
                               reason=ev.reason)
                elif isinstance(ev, Notice):
                    rec["notices"].append(f"{ev.level}: {ev.message}")
                elif isinstance(ev, Error):
                    rec["error"] = ev.message
                    token_ids = list(ev.token_ids)
            rec.update(rounds=tally.num_rounds, drafted=tally.num_drafted, accepted=tally.num_accepted,
                       ssd_rounds=tally.num_ssd_rounds, hits=tally.num_hits, draft_s=tally.draft_s, verify_s=tally.verify_s,
                       wait_s=tally.wait_s)
            rec["elapsed_s"] = time.perf_counter() - t0
            if bg0 is not None:
                bg1 = descendants_cpu_s(ranks)
                rec["background_cpu_s"] = None if bg1 is None else bg1 - bg0
            out.tokens[rec["run_id"]] = tuple(token_ids)
            return rec

        def warm_up(key: tuple) -> None:
            rec = one(key, prompts[0], -1, min(settings.warmup_tokens, settings.max_new_tokens), 0)
            if rec["error"]:
                raise BenchError(f"{slots[key].mode} failed during warm-up: {rec['error']}")

        out.weight_bytes = weight_bytes(models_for(slots[keys[0]])[0].model)
        # warm-up: every configuration once, on the first prompt, not recorded; and the memory bandwidth
        # its placement reads at (the memory bound of the report)
        for key in keys:
            plan = slots[key]
            pin.apply(plan.cores, plan.threads)
            out.bandwidth[plan.slot_id] = read_bandwidth(plan.target_device)
            warm_up(key)
        # a warm-up that started building compiled graphs (``--compile auto`` on a CPU, the first time on
        # this machine): race what later replies run, not eager replies beside a build on the other core
        waited = [e.target.forwards.wait_for_builds(lambda busy: progress(f"waiting for the graphs the replies will run: {busy}"))
                  for e in engines.values()]
        if any(waited):
            for key in keys:
                warm_up(key)  # pinned as the race pins it (one() applies the plan's pinning)
        total = len(prompts) * settings.repeats * len(keys)
        done = 0
        for pi, prompt in enumerate(prompts):
            for repeat in range(settings.repeats):
                shift = (pi * settings.repeats + repeat) % len(keys)
                for order, key in enumerate(keys[shift:] + keys[:shift]):
                    rec = one(key, prompt, repeat, settings.max_new_tokens, order)
                    out.runs.append(rec)
                    done += 1
                    plan = slots[key]
                    progress(f"[{done}/{total}] {plan.mode:<3} {cores_text(plan.cores) if plan.cores else plan.target_device:<5} {prompt.id:<16} "
                             + (f"error: {rec['error']}" if rec["error"] else
                                f"{rec['tok_per_s'] or 0:6.1f} tok/s" + (f", accepted length {1 + rec['accepted'] / rec['rounds']:.2f}" if rec["rounds"] else "")))
        out.channel_rtt_ms = _channel_rtt_ms(engines)
    finally:
        close_all(engines, pin)
    return out


def close_all(engines: dict[tuple, Any], pin: Pinning) -> None:
    """Close every engine (best effort: never mask the real error) and undo the pinning."""
    for eng in engines.values():
        with contextlib.suppress(Exception):
            eng.close()
    pin.restore()


def build_engines(base_config: Any, models_for: Callable[[Plan], tuple[Any, Any]], plans: list[Plan],
                  skipped: dict[str, str], engines: dict[tuple, Any]) -> tuple[dict[tuple, Plan], dict[tuple, Any]]:
    """One Engine per distinct configuration (slot), sharing the loaded models, added to ``engines`` (the
    caller closes them, also on an error); building each decoder here makes a missing one (ImportError) a
    clear message in ``skipped`` before anything is timed.  A BenchError when no mode can run."""
    from ..engine import Engine

    slots: dict[tuple, Plan] = {}
    for p in plans:
        slots.setdefault(p.slot, p)
    for key, plan in list(slots.items()):
        if plan.mode in skipped:
            del slots[key]
            continue
        target, draft = models_for(plan)
        cfg = replace(base_config, mode=plan.mode, target_device=plan.target_device, draft_device=plan.draft_device)
        eng = None
        try:  # unpinned: the SSD decoder checks its --draft-device cores against this process's affinity
            eng = Engine(cfg, target, draft if plan.mode != "ar" else None)  # refuses a draft the mode cannot use
            eng.decoder()
        except Exception as e:  # noqa: BLE001 - any failure to build a decoder skips that mode, loudly
            skipped[plan.mode] = (f"the {plan.mode.upper()} decoder is not available in this build ({e})"
                                  if isinstance(e, ImportError) else f"{type(e).__name__}: {e}")
            if eng is not None:
                eng.close()
            del slots[key]
            continue
        engines[key] = eng
    if not engines:
        raise BenchError("no mode could run: " + "; ".join(f"{m}: {w}" for m, w in skipped.items()))
    return slots, engines


def _channel_rtt_ms(engines: dict[tuple, Any]) -> float | None:
    """The SSD verifier ⇄ speculator round trip, if the SSD decoder can measure it (``ping()``, seconds)."""
    for eng in engines.values():
        if eng.config.mode == "ssd":
            dec = eng.decoder()  # built before the race, so this only looks it up
            ping = getattr(dec, "ping", None) or getattr(getattr(dec, "channel", None), "ping", None)
            if callable(ping):
                try:
                    samples = sorted(float(ping()) for _ in range(200))
                except Exception:  # noqa: BLE001
                    return None
                return samples[len(samples) // 2] * 1e3
    return None


class ModelPool:
    """Loads each model once per device (on CPU: once) and hands them to the plans."""

    def __init__(self, values: dict[str, Any], plans: list[Plan], progress: Callable[[str], None] | None = None) -> None:
        from ..chat.settings import engine_config
        from ..engine import Engine, default_draft

        self.values = values
        self._progress = progress or (lambda s: None)
        needs_draft = any(p.mode != "ar" for p in plans)
        first = next((p for p in plans if p.mode != "ar"), plans[0])
        cfg = engine_config({**values, "mode": first.mode if needs_draft else "ar",
                                 "target_device": first.target_device, "draft_device": first.draft_device})
        self.base_config = cfg
        self.draft_name = (cfg.draft or default_draft(cfg.target)) if needs_draft else None

        said = [""]

        def progress(stage: str, frac: float | None) -> None:  # noqa: ARG001
            if stage != said[0]:  # the load reports a stage at every step of its fraction: print it once
                said[0] = stage
                self._progress(stage)

        engine = Engine.load(cfg, progress=progress)  # checks target/draft tokenizers, loads both
        self._targets = {self._key(first.target_device): engine.target}
        self._drafts = {(self._key(first.target_device), self._key(first.draft_device)): engine.draft}
        self._first = engine

    @staticmethod
    def _key(device: str) -> str:
        import torch

        d = device.strip().lower()
        return "cpu" if d.startswith("cpu") or d == "auto" and not torch.cuda.is_available() else d

    def models_for(self, plan: Plan) -> tuple[Any, Any]:
        from ..engine import (derive_in_precision, draft_base, is_derived, load_with_precision, load_sharded,
                              parse_placement)

        tk = self._key(plan.target_device)
        dtype, trust = self.values.get("dtype"), bool(self.values.get("trust_remote_code"))
        if tk not in self._targets:
            self._progress(f"loading {self.values['target']} on {plan.target_device}")
            place = parse_placement(plan.target_device, dtype or "auto")
            if place.ranks:
                self._targets[tk] = load_sharded(self.values["target"], place, self.base_config.compile,
                                                 (1, self.base_config.k + 1), trust)
            else:
                self._targets[tk] = load_with_precision(self.values["target"], place, dtype, trust)
        target = self._targets[tk]
        if plan.mode == "ar" or self.draft_name is None:
            return target, None
        dk = (tk, self._key(plan.draft_device))
        if dk not in self._drafts:
            if is_derived(self.draft_name):
                self._drafts[dk] = derive_in_precision(self.draft_name, draft_base(target))  # in the target's precision
            else:
                self._progress(f"loading {self.draft_name} on {plan.draft_device}")
                place = parse_placement(plan.draft_device, dtype or "auto")
                self._drafts[dk] = load_with_precision(self.draft_name, place, dtype, trust)
        return target, self._drafts[dk]

    def decode(self, ids: list[int]) -> str:
        return self._first.target.tokenizer.decode(ids, skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        from ..engine import num_params, precision_of

        t = self._first.target
        out: dict[str, Any] = {"target": {"name": t.name, "params": num_params(t), "dtype": str(t.placement.dtype).removeprefix("torch."),
                                          "precision": precision_of(t)}}
        d = self._first.draft
        if d is not None:
            out["draft"] = {"name": d.name, "params": num_params(d), "precision": precision_of(d)}
        return out
