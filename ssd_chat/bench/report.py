"""What ``ssd-chat bench`` makes of its runs: summaries, ratios, greedy exactness and two physical
bounds, as the report (a dict, written as JSON) that :mod:`.render` and :mod:`.plot` show.

The summaries are pure functions of the run records that :mod:`.runner` collects, so the tests can
feed them hand-made records.  Names follow the paper / vLLM vocabulary:

* decode tok/s = tokens after the first block / (t_last_token - t_first_token), per reply (prefill excluded)
* TTFT = time to the first token (prefill + first round)
* mean accepted length = 1 + accepted draft tokens / verifications (bonus included)
* acceptance rate = accepted draft tokens / drafted tokens
* cache-hit rate = SSD rounds whose speculation was in the cache / SSD rounds
* draft bound: with the same draft, SSD/SD <= 1 + (SD draft time per round / SD verify time per round)
* memory bound: a batch-1 forward reads every weight of the target once, so it takes at least
  weight bytes / measured read bandwidth; a mode decodes at most its tokens per target forward
  (AR 1, SD and SSD their mean accepted length) per that time
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..engine import ssd_over_sd_bound
from .machine import Pinning
from .prompts import BenchPrompt
from .protocols import Plan
from .runner import BenchRun, BenchSettings

SCHEMA = "ssd-chat-bench/1"
RATIOS = (("ssd", "sd"), ("ssd", "ar"), ("sd", "ar"))


def spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Median, quartiles and range of the values that exist."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "p25": None, "p75": None, "min": None, "max": None}
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs[0],) * 3
    return {"n": len(xs), "median": statistics.median(xs), "p25": q1, "p75": q3, "min": xs[0], "max": xs[-1]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def first_divergence(ref: tuple[int, ...], other: tuple[int, ...]) -> int | None:
    """Index of the first token where two replies differ (None: identical)."""
    for i, (x, y) in enumerate(zip(ref, other)):
        if x != y:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


# --- per mode -------------------------------------------------------------------------------


def summarize_mode(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode under one protocol, over all its measured runs."""
    ok = [r for r in runs if r.get("error") is None]
    rounds = sum(r["rounds"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)
    accepted = sum(r["accepted"] for r in ok)
    ssd_rounds = sum(r["ssd_rounds"] for r in ok)
    hits = sum(r["hits"] for r in ok)
    hit_rounds_verify = sum(r["verify_on_hit_s"] for r in ok)
    by_family: dict[str, list[float]] = {}
    for r in ok:
        if r["tok_per_s"] is not None:
            by_family.setdefault(r["family"], []).append(r["tok_per_s"])
    wall = sum(r["elapsed_s"] for r in ok)
    background = [r["background_cpu_s"] for r in ok if r.get("background_cpu_s") is not None]
    per_round = (lambda key: sum(r[key] for r in ok) / rounds) if rounds else (lambda key: None)  # noqa: E731
    return {
        "runs": len(runs),
        "failed": len(runs) - len(ok),
        "new_tokens": sum(r["new_tokens"] for r in ok),
        "tok_per_s": spread(r["tok_per_s"] for r in ok),
        "tok_per_s_by_family": {f: statistics.median(v) for f, v in sorted(by_family.items())},
        "ttft_s": spread(r["ttft_s"] for r in ok),
        "rounds": rounds,
        "mean_accepted_length": (1 + accepted / rounds) if rounds else None,
        "acceptance_rate": (accepted / drafted) if drafted else None,
        "cache_hit_rate": (hits / ssd_rounds) if ssd_rounds else None,
        "draft_s_per_round": per_round("draft_s"),
        "verify_s_per_round": per_round("verify_s"),
        "wait_s_per_round": per_round("wait_s") if ssd_rounds else None,
        "wait_on_hit_s_per_hit": (sum(r["wait_on_hit_s"] for r in ok) / hits) if hits else None,
        "wait_on_hit_over_verify": (
            (sum(r["wait_on_hit_s"] for r in ok) / hits) / (hit_rounds_verify / hits) if hits and hit_rounds_verify else None
        ),
        "speculator_busy_s_per_round": (sum(r["speculator_busy_s"] for r in ok) / ssd_rounds) if ssd_rounds else None,
        "fallback_rounds": sum(r["fallback_rounds"] for r in ok),
        "notices": sorted({n for r in runs for n in r.get("notices", [])}),
        "background_cpu_frac": (sum(background) / wall) if background and wall else None,
    }


# --- per protocol ---------------------------------------------------------------------------


def paired_ratio(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> float | None:
    """Median over (prompt, repeat) of tok/s(a) / tok/s(b): each pair ran back to back."""
    b_by = {(r["prompt_id"], r["repeat"]): r["tok_per_s"] for r in runs_b if r.get("error") is None}
    xs = [
        r["tok_per_s"] / b_by[(r["prompt_id"], r["repeat"])]
        for r in runs_a
        if r.get("error") is None and r["tok_per_s"] and b_by.get((r["prompt_id"], r["repeat"]))
    ]
    return statistics.median(xs) if xs else None


def exactness(runs_by_mode: dict[str, list[dict[str, Any]]], tokens: dict[str, tuple[int, ...]],
              decode: Any = None) -> dict[str, Any]:
    """Greedy only: did SD and SSD produce exactly AR's tokens, prompt by prompt?

    ``tokens`` maps a run's ``run_id`` to its token ids; ``decode`` (optional) turns ids into text
    for the report."""
    if "ar" not in runs_by_mode:
        return {"checked": False, "reason": "no AR run to compare with", "modes": {}}
    ref = {(r["prompt_id"], r["repeat"]): tokens.get(r["run_id"]) for r in runs_by_mode["ar"] if r.get("error") is None}
    out: dict[str, Any] = {"checked": True, "reference": "ar", "modes": {}}
    for mode, runs in runs_by_mode.items():
        if mode == "ar":
            continue
        compared = identical = 0
        mismatches = []
        for r in runs:
            want = ref.get((r["prompt_id"], r["repeat"]))
            got = tokens.get(r["run_id"])
            if r.get("error") is not None or want is None or got is None:
                continue
            compared += 1
            pos = first_divergence(want, got)
            if pos is None:
                identical += 1
                continue
            m: dict[str, Any] = {
                "prompt_id": r["prompt_id"], "repeat": r["repeat"], "position": pos,
                "ar_token": want[pos] if pos < len(want) else None, "token": got[pos] if pos < len(got) else None,
                "ar_length": len(want), "length": len(got),
            }
            if decode is not None:
                m["ar_text_from_there"] = decode(list(want[pos : pos + 8]))
                m["text_from_there"] = decode(list(got[pos : pos + 8]))
                m["common_prefix_text"] = decode(list(want[max(0, pos - 8) : pos]))
            mismatches.append(m)
        out["modes"][mode] = {"compared": compared, "identical": identical, "mismatches": mismatches}
    out["all_identical"] = all(v["compared"] == v["identical"] for v in out["modes"].values())
    return out


def summarize_protocol(name: str, runs_by_mode: dict[str, list[dict[str, Any]]], greedy: bool,
                       tokens: dict[str, tuple[int, ...]], decode: Any = None) -> dict[str, Any]:
    modes = {m: summarize_mode(rs) for m, rs in runs_by_mode.items()}
    ratios = {f"{a}/{b}": {"of_medians": _ratio(modes[a]["tok_per_s"]["median"], modes[b]["tok_per_s"]["median"]),
                           "paired_median": paired_ratio(runs_by_mode[a], runs_by_mode[b])}
              for a, b in RATIOS if a in modes and b in modes}
    bound: dict[str, Any] | None = None
    # the bound needs SD on the hardware of SSD's verifier: the paper protocol (see with_equal_bound for the other)
    if name == "paper" and "sd" in modes and modes["sd"]["verify_s_per_round"]:
        d, v = modes["sd"]["draft_s_per_round"], modes["sd"]["verify_s_per_round"]
        sd_med = modes["sd"]["tok_per_s"]["median"]
        mx, r = ssd_over_sd_bound(d, v), ratios.get("ssd/sd", {}).get("of_medians")
        bound = {"sd_draft_s_per_round": d, "sd_verify_s_per_round": v, "ssd_over_sd_max": mx,
                 "ssd_tok_per_s_max": sd_med * mx if sd_med else None, "measured_over_bound": r / mx if r is not None else None}
    return {
        "modes": modes,
        "ratios": ratios,
        "bound": bound,
        "exactness": exactness(runs_by_mode, tokens, decode) if greedy else
        {"checked": False, "reason": "sampling (temperature > 0): exactness is distributional, see the test suite", "modes": {}},
    }


def with_equal_bound(protocols: dict[str, Any]) -> None:
    """Under ``equal``, SD has more hardware than SSD's verifier, so its own draft/verify split does not bound SSD.
    SSD's ceiling in tok/s is the same as under ``paper`` (same placement): SD(paper) × (1 + draft/verify);
    relative to this protocol's SD that is ceiling / SD(equal)."""
    paper, equal = protocols.get("paper"), protocols.get("equal")
    if equal is None or "sd" not in equal["modes"] or "ssd" not in equal["modes"]:
        return
    pb = paper["bound"] if paper else None
    sd_med = equal["modes"]["sd"]["tok_per_s"]["median"]
    if not pb or not pb.get("ssd_tok_per_s_max") or not sd_med:
        equal["bound"] = None
        return
    mx = pb["ssd_tok_per_s_max"] / sd_med
    r = equal["ratios"].get("ssd/sd", {}).get("of_medians")
    equal["bound"] = {"sd_draft_s_per_round": pb["sd_draft_s_per_round"], "sd_verify_s_per_round": pb["sd_verify_s_per_round"],
                      "ssd_tok_per_s_max": pb["ssd_tok_per_s_max"], "ssd_over_sd_max": mx,
                      "measured_over_bound": (r / mx) if r is not None else None,
                      "source": "SSD's ceiling from the paper protocol's SD (same verifier placement) / this protocol's SD"}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


def write_files(report: dict[str, Any], console: Any, json_file: Path | None, plot_file: Path | None, markdown_file: Path | None,
                plot: Callable[[dict[str, Any], Path], None], markdown: Callable[[dict[str, Any]], str]) -> None:
    """The files --json, --plot and --markdown ask for, each with a line saying where it went."""
    if json_file is not None:
        write_json(report, json_file)
        console.print(f"JSON written to {json_file}")
    if plot_file is not None:
        plot(report, plot_file)
        console.print(f"plot written to {plot_file}")
    if markdown_file is not None:
        markdown_file.parent.mkdir(parents=True, exist_ok=True)
        markdown_file.write_text(markdown(report))
        console.print(f"Markdown written to {markdown_file}")


def build_report(result: BenchRun, plans: list[Plan], settings: BenchSettings, prompts: list[BenchPrompt],
                 prompt_source: str, models: dict[str, Any], base: dict[str, Any], machine: dict[str, Any],
                 notes: list[str], decode: Callable[[list[int]], str] | None = None) -> dict[str, Any]:
    by_slot: dict[str, list[dict[str, Any]]] = {}
    for r in result.runs:
        by_slot.setdefault(r["slot"], []).append(r)
    protocols: dict[str, Any] = {}
    placements: dict[str, Any] = {}
    placements_text: dict[str, str] = {}
    for proto in settings.protocols:
        pp = [p for p in plans if p.protocol == proto and p.mode not in result.skipped]
        runs_by_mode = {p.mode: by_slot.get(p.slot_id, []) for p in pp}
        protocols[proto] = summarize_protocol(proto, runs_by_mode, settings.sampling.temperature == 0, result.tokens, decode)
        protocols[proto]["memory_bound"] = memory_bound(protocols[proto]["modes"], {p.mode: p.slot_id for p in pp},
                                                        result.weight_bytes, result.bandwidth)
        placements[proto] = {p.mode: {**{k: v for k, v in asdict(p).items() if k not in ("protocol", "mode")}, "slot": p.slot_id,
                                      "description": p.describe()} for p in pp}
        placements_text[proto] = "; ".join(f"{p.mode.upper()}: {p.describe()}" for p in pp)
    with_equal_bound(protocols)
    shared = {p.slot_id for p in plans if p.protocol == "paper"} & {p.slot_id for p in plans if p.protocol == "equal"}
    if shared:
        modes = sorted({p.mode for p in plans if p.slot_id in shared})
        notes = [*notes, f"{', '.join(m.upper() for m in modes)} has the same placement under both protocols: its runs are measured once and reported under both"]
    if hasattr(os, "getloadavg"):
        machine = {**machine, "loadavg_end": list(os.getloadavg())}
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(["ssd-chat", *sys.argv[1:]]) if sys.argv and "ssd-chat" in Path(sys.argv[0]).name else None,
        "machine": machine,
        "models": models,
        "settings": {
            "k": base.get("k"), "max_new_tokens": settings.max_new_tokens, "ignore_eos": settings.sampling.ignore_eos,
            **{k: getattr(settings.sampling, k) for k in ("temperature", "top_p", "top_k", "seed", "repetition_penalty",
                                                         "frequency_penalty", "presence_penalty")},
            "repeats": settings.repeats, "warmup_tokens": settings.warmup_tokens, "modes": list(settings.modes),
            "fan_out": base.get("fan_out"), "budget": base.get("budget"), "saguaro_c": base.get("saguaro_c"),
            "fallback": base.get("fallback"), "pinning_enforced": Pinning().enforced,
            "prompts": {"source": prompt_source, "count": len(prompts), "families": dict(Counter(p.family for p in prompts))},
        },
        "notes": notes,
        "skipped_modes": result.skipped,
        "placements": placements,
        "placements_text": placements_text,
        "protocols": protocols,
        "channel_round_trip_ms": result.channel_rtt_ms,
        "runs": result.runs,
    }


def memory_bound(modes: dict[str, Any], slots: dict[str, str], weight_bytes: int | None,
                 bandwidth: dict[str, float]) -> dict[str, Any] | None:
    """Per mode: the read bandwidth its placement measured, the least time a forward can take (weight bytes /
    bandwidth), the decode rate that allows (tokens per target forward / that time) and the measured share of it."""
    if not weight_bytes:
        return None
    out: dict[str, Any] = {"weight_bytes": weight_bytes, "modes": {}}
    for mode, m in modes.items():
        bw = bandwidth.get(slots.get(mode, ""))
        if not bw:
            continue
        forward_s = weight_bytes / bw
        most = (m["mean_accepted_length"] or 1.0) / forward_s
        med = m["tok_per_s"]["median"]
        out["modes"][mode] = {"bandwidth_bytes_per_s": bw, "forward_s_min": forward_s, "tok_per_s_max": most,
                              "measured_over_bound": med / most if med else None}
    return out
