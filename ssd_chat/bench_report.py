"""What ``ssd-chat bench`` makes of its runs: summaries, ratios, the physical bound,
greedy exactness, the issue's targets; and the three ways to show them (a rich
table, JSON, a PNG plot).

Everything here is a pure function of the run records that :mod:`ssd_chat.bench`
collects, so the tests can feed it hand-made records.

Names follow the paper / vLLM vocabulary:

* decode tok/s = (n - 1) / (t_last_token - t_first_token), per reply (prefill excluded)
* TTFT = time to the first token (prefill + first round)
* mean accepted length = 1 + accepted draft tokens / verifications (bonus included)
* acceptance rate = accepted draft tokens / drafted tokens
* cache-hit rate = SSD rounds whose speculation was in the cache / SSD rounds
* bound: with the same draft, SSD/SD <= 1 + (SD draft time per round / SD verify time per round)
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SCHEMA = "ssd-chat-bench/1"
RATIOS = (("ssd", "sd"), ("ssd", "ar"), ("sd", "ar"))
# the issue's targets (paper protocol, greedy, medians over the prompt sets)
TARGET_SSD_OVER_SD = 1.3
TARGET_WAIT_OVER_VERIFY = 0.10
TARGET_CHANNEL_RTT_MS = 1.0


# --- small statistics ------------------------------------------------------------------------


def spread(values: Iterable[float | None]) -> dict[str, float | int | None]:
    """Median, quartiles and range of the values that exist."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "p25": None, "p75": None, "min": None, "max": None}
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
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
                       tokens: dict[str, tuple[int, ...]], decode: Any = None,
                       channel_rtt_ms: float | None = None) -> dict[str, Any]:
    modes = {m: summarize_mode(rs) for m, rs in runs_by_mode.items()}
    ratios: dict[str, Any] = {}
    for a, b in RATIOS:
        if a in modes and b in modes:
            ratios[f"{a}/{b}"] = {
                "of_medians": _ratio(modes[a]["tok_per_s"]["median"], modes[b]["tok_per_s"]["median"]),
                "paired_median": paired_ratio(runs_by_mode[a], runs_by_mode[b]),
            }
    bound: dict[str, Any] | None = None
    # the bound needs SD on the hardware of SSD's verifier: the paper protocol (see with_equal_bound for the other)
    if name == "paper" and "sd" in modes and modes["sd"]["verify_s_per_round"]:
        d, v = modes["sd"]["draft_s_per_round"], modes["sd"]["verify_s_per_round"]
        sd_med = modes["sd"]["tok_per_s"]["median"]
        bound = {"sd_draft_s_per_round": d, "sd_verify_s_per_round": v, "ssd_over_sd_max": 1 + d / v,
                 "ssd_tok_per_s_max": sd_med * (1 + d / v) if sd_med else None, "measured_over_bound": None}
        if "ssd/sd" in ratios and ratios["ssd/sd"]["of_medians"] is not None:
            bound["measured_over_bound"] = ratios["ssd/sd"]["of_medians"] / bound["ssd_over_sd_max"]
    out = {
        "modes": modes,
        "ratios": ratios,
        "bound": bound,
        "exactness": exactness(runs_by_mode, tokens, decode) if greedy else
        {"checked": False, "reason": "sampling (temperature > 0): exactness is distributional, see the test suite", "modes": {}},
    }
    if name == "paper":
        out["targets"] = targets(modes, ratios, greedy, channel_rtt_ms)
    return out


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


def targets(modes: dict[str, Any], ratios: dict[str, Any], greedy: bool, channel_rtt_ms: float | None) -> dict[str, Any]:
    """The issue's three targets, each with its measured value and whether it was met (None: not measured)."""
    ssd_sd = ratios.get("ssd/sd", {}).get("of_medians")
    wait = modes.get("ssd", {}).get("wait_on_hit_over_verify")

    def verdict(value: float | None, ok: bool) -> bool | None:
        return None if value is None else ok

    return {
        "greedy": greedy,
        "ssd_over_sd": {"value": ssd_sd, "target": f">= {TARGET_SSD_OVER_SD}",
                        "met": verdict(ssd_sd, ssd_sd is not None and ssd_sd >= TARGET_SSD_OVER_SD)},
        "wait_on_hit_over_verify": {"value": wait, "target": f"< {TARGET_WAIT_OVER_VERIFY}",
                                    "met": verdict(wait, wait is not None and wait < TARGET_WAIT_OVER_VERIFY)},
        "channel_round_trip_ms": {"value": channel_rtt_ms, "target": f"< {TARGET_CHANNEL_RTT_MS}",
                                  "met": verdict(channel_rtt_ms, channel_rtt_ms is not None and channel_rtt_ms < TARGET_CHANNEL_RTT_MS)},
    }


# --- output: JSON ---------------------------------------------------------------------------


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


# --- output: terminal -----------------------------------------------------------------------


def _f(v: float | None, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def render(report: dict[str, Any], console: Any) -> None:
    """Rich tables, one per protocol, then ratios, bound, exactness and targets."""
    from rich.table import Table

    models = report["models"]
    s = report["settings"]
    temp_text = "greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"
    console.print(
        f"[bold]ssd-chat bench[/]: target [cyan]{models['target']['name']}[/], draft [cyan]{models['draft']['name'] if models.get('draft') else '–'}[/], "
        f"k={s['k']}, {s['max_new_tokens']} new tokens{' (EOS ignored)' if s['ignore_eos'] else ''}, "
        f"{temp_text}, "
        f"{s['prompts']['count']} prompts × {s['repeats']} repeat(s) from {s['prompts']['source']}"
    )
    for mode, why in report.get("skipped_modes", {}).items():
        console.print(f"[bold yellow]mode {mode} skipped[/]: {why}")
    for proto, p in report["protocols"].items():
        console.print(f"\n[bold]protocol {proto}[/]: {report['placements_text'][proto]}")
        table = Table()
        for col, just in (("mode", "left"), ("tok/s", "right"), ("IQR", "right"), ("range", "right"),
                          ("TTFT s", "right"), ("acc. len", "right"), ("accept", "right"),
                          ("hits", "right"), ("runs", "right"), ("= AR", "center")):
            table.add_column(col, justify=just)  # type: ignore[arg-type]
        exact = p["exactness"]
        for mode, m in p["modes"].items():
            t = m["tok_per_s"]
            if not exact["checked"]:
                eq = "n/a"
            elif mode == "ar":
                eq = "ref"
            else:
                e = exact["modes"].get(mode, {})
                eq = f"[green]{e['identical']}/{e['compared']}[/]" if e.get("compared") == e.get("identical") else f"[bold red]{e['identical']}/{e['compared']}[/]"
            table.add_row(
                mode, _f(t["median"], ".1f"), f"{_f(t['p25'], '.1f')}–{_f(t['p75'], '.1f')}", f"{_f(t['min'], '.1f')}–{_f(t['max'], '.1f')}",
                _f(m["ttft_s"]["median"], ".3f"), _f(m["mean_accepted_length"], ".2f"), _f(m["acceptance_rate"], ".0%"),
                _f(m["cache_hit_rate"], ".0%"), f"{m['runs'] - m['failed']}" + (f" [red]({m['failed']} failed)[/]" if m["failed"] else ""), eq,
            )
        console.print(table)
        parts = []
        for key, r in p["ratios"].items():
            parts.append(f"{key.upper()} {_f(r['of_medians'], '.2f', '×')} (paired {_f(r['paired_median'], '.2f', '×')})")
        if parts:
            console.print("  ratios of medians: " + ", ".join(parts))
        b = p["bound"]
        if b is not None and "source" not in b:
            console.print(
                f"  physical bound: SSD/SD ≤ 1 + draft/verify = 1 + {b['sd_draft_s_per_round'] * 1e3:.1f} ms / {b['sd_verify_s_per_round'] * 1e3:.1f} ms "
                f"= {b['ssd_over_sd_max']:.2f}× (SSD ≤ {_f(b['ssd_tok_per_s_max'], '.1f')} tok/s); measured/bound {_f(b['measured_over_bound'], '.0%')}"
            )
        elif b is not None:
            console.print(
                f"  physical bound: SSD ≤ {b['ssd_tok_per_s_max']:.1f} tok/s (paper protocol's SD × (1 + draft/verify)), i.e. SSD/SD ≤ "
                f"{b['ssd_over_sd_max']:.2f}× against this protocol's SD; measured/bound {_f(b['measured_over_bound'], '.0%')}"
            )
        ssd = p["modes"].get("ssd")
        if ssd and ssd["wait_on_hit_over_verify"] is not None:
            console.print(
                f"  SSD verifier wait on a hit: {ssd['wait_on_hit_s_per_hit'] * 1e3:.2f} ms = {ssd['wait_on_hit_over_verify']:.1%} of a verify pass"
                f" ({ssd['verify_s_per_round'] * 1e3:.1f} ms); speculator busy {_f(ssd['speculator_busy_s_per_round'] and ssd['speculator_busy_s_per_round'] * 1e3, '.1f', ' ms')} per round"
                + (f"; {ssd['fallback_rounds']} fallback rounds" if ssd["fallback_rounds"] else "")
            )
        for mode, m in p["modes"].items():
            for n in m.get("notices", []):
                if n.startswith("warning"):
                    console.print(f"  [bold yellow]{mode} notice[/]: {n.removeprefix('warning: ')}")
        for mode, m in p["modes"].items():
            if m["background_cpu_frac"] is not None and m["background_cpu_frac"] > 0.05:
                console.print(f"  [yellow]warning[/]: during {mode} runs other processes of this app used {m['background_cpu_frac']:.0%} of a core")
        if exact["checked"]:
            for mode, e in exact["modes"].items():
                for mm in e["mismatches"][:5]:
                    console.print(
                        f"  [bold white on red] GREEDY MISMATCH [/] {mode} differs from AR on {mm['prompt_id']} (repeat {mm['repeat']}) "
                        f"at token {mm['position']}: AR {mm['ar_token']} {mm.get('ar_text_from_there', '')!r} vs {mode} {mm['token']} {mm.get('text_from_there', '')!r}"
                    )
                if len(e["mismatches"]) > 5:
                    console.print(f"  … and {len(e['mismatches']) - 5} more {mode} mismatches (see the JSON)")
            if exact.get("all_identical") and exact["modes"]:
                console.print("  [green]greedy exactness: every SD/SSD reply is token-for-token identical to AR's[/]")
        elif exact.get("reason"):
            console.print(f"  exactness not checked: {exact['reason']}")
        tg = p.get("targets")
        if tg:
            def mark(t: dict[str, Any]) -> str:
                return "[dim]not measured[/]" if t["met"] is None else ("[green]met[/]" if t["met"] else "[red]not met[/]")

            w = tg["wait_on_hit_over_verify"]
            c = tg["channel_round_trip_ms"]
            console.print(
                f"  targets: SSD/SD {_f(tg['ssd_over_sd']['value'], '.2f', '×')} (≥ {TARGET_SSD_OVER_SD}×: {mark(tg['ssd_over_sd'])}); "
                f"wait on hit {_f(w['value'], '.1%')} of verify (< 10 %: {mark(w)}); "
                f"channel round trip {_f(c['value'], '.3f', ' ms')} (< 1 ms: {mark(c)})"
            )
    console.print("[dim]tok/s: decode rate per reply (median, IQR, range); TTFT: median; acc. len: mean accepted length (bonus "
                  "included); accept: acceptance rate; hits: SSD cache-hit rate; = AR: greedy replies identical to AR's[/]")
    fams = sorted({f for p in report["protocols"].values() for m in p["modes"].values() for f in m["tok_per_s_by_family"]})
    if len(fams) > 1:
        table = Table(title="median decode tok/s by prompt family", title_justify="left")
        table.add_column("protocol / mode")
        for f in fams:
            table.add_column(f, justify="right")
        for proto, p in report["protocols"].items():
            for mode, m in p["modes"].items():
                table.add_row(f"{proto} / {mode}", *(_f(m["tok_per_s_by_family"].get(f), ".1f") for f in fams))
        console.print(table)


# --- output: plot ---------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    """Bars of median decode tok/s (IQR whiskers) per protocol and mode, and per family for the first protocol."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protos = list(report["protocols"])
    modes = [m for m in ("ar", "sd", "ssd") if any(m in report["protocols"][p]["modes"] for p in protos)]
    colours = {"ar": "#888888", "sd": "#4C72B0", "ssd": "#DD8452"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    ax = axes[0]
    width = 0.8 / max(1, len(modes))
    for i, mode in enumerate(modes):
        xs, ys, lo, hi = [], [], [], []
        for j, proto in enumerate(protos):
            m = report["protocols"][proto]["modes"].get(mode)
            if m is None or m["tok_per_s"]["median"] is None:
                continue
            t = m["tok_per_s"]
            xs.append(j + (i - (len(modes) - 1) / 2) * width)
            ys.append(t["median"])
            lo.append(t["median"] - t["p25"])
            hi.append(t["p75"] - t["median"])
        bars = ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=mode.upper(), color=colours.get(mode))
        ax.bar_label(bars, fmt="%.1f", fontsize=8, padding=2)
        if mode == "ssd":  # the physical bound: SD's median x (1 + draft/verify)
            for x, proto in zip(xs, [p for p in protos if report["protocols"][p]["modes"].get("ssd")]):
                pr = report["protocols"][proto]
                b, sd = pr["bound"], pr["modes"].get("sd")
                if b and sd and sd["tok_per_s"]["median"]:
                    y = sd["tok_per_s"]["median"] * b["ssd_over_sd_max"]
                    ax.plot([x - width / 2, x + width / 2], [y, y], "k--", lw=1)
                    ax.annotate("bound", (x, y), fontsize=7, ha="center", va="bottom")
    ax.set_xticks(range(len(protos)), [f"{p} protocol" for p in protos])
    ax.set_ylabel("decode tok/s (median, IQR)")
    ratio_txt = []
    for proto in protos:
        r = report["protocols"][proto]["ratios"]
        ratio_txt.append(f"{proto}: " + ", ".join(f"{k.upper()} {v['of_medians']:.2f}×" for k, v in r.items() if v["of_medians"] is not None))
    ax.set_title("\n".join(ratio_txt), fontsize=8)
    ax.legend()
    ax = axes[1]
    first = report["protocols"][protos[0]]["modes"]
    fams = sorted({f for m in first.values() for f in m["tok_per_s_by_family"]})
    for i, mode in enumerate(modes):
        m = first.get(mode)
        if m is None:
            continue
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(fams))]
        ax.bar(xs, [m["tok_per_s_by_family"].get(f, 0.0) for f in fams], width, label=mode.upper(), color=colours.get(mode))
    ax.set_xticks(range(len(fams)), fams)
    ax.set_ylabel("decode tok/s (median)")
    ax.set_title(f"by prompt family ({protos[0]} protocol)", fontsize=9)
    models = report["models"]
    fig.suptitle(
        f"ssd-chat bench: {models['target']['name']} + draft {models['draft']['name'] if models.get('draft') else '–'}, "
        f"k={report['settings']['k']}, {report['settings']['max_new_tokens']} tokens, {report['machine']['summary']}",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- output: Markdown (for the README) ----------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """The summary as Markdown tables: one row per protocol and mode, then ratios, bound and targets."""
    s, models = report["settings"], report["models"]
    lines = [
        f"Target `{models['target']['name']}`, draft `{models['draft']['name'] if models.get('draft') else '–'}`, k={s['k']}, "
        f"{s['max_new_tokens']} new tokens per reply{' (EOS ignored)' if s['ignore_eos'] else ''}, "
        f"{'greedy' if s['temperature'] == 0 else 'temperature ' + str(s['temperature'])}, {s['prompts']['count']} prompts "
        f"({', '.join(f'{n} {f}' for f, n in s['prompts']['families'].items())}) × {s['repeats']} repeat(s); "
        f"machine: {report['machine']['summary']}.",
        "",
        "| protocol | mode | placement | decode tok/s median (IQR) | TTFT s | mean accepted length | acceptance | cache hits | greedy = AR |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for proto, p in report["protocols"].items():
        ex = p["exactness"]
        for mode, m in p["modes"].items():
            t = m["tok_per_s"]
            if not ex["checked"]:
                eq = "n/a"
            elif mode == "ar":
                eq = "reference"
            else:
                e = ex["modes"].get(mode, {})
                eq = f"{e.get('identical')}/{e.get('compared')}"
            lines.append(
                f"| {proto} | {mode.upper()} | {report['placements'][proto][mode]['description']} | "
                f"**{_f(t['median'], '.1f')}** ({_f(t['p25'], '.1f')}–{_f(t['p75'], '.1f')}) | {_f(m['ttft_s']['median'], '.2f')} | "
                f"{_f(m['mean_accepted_length'], '.2f')} | {_f(m['acceptance_rate'], '.0%')} | {_f(m['cache_hit_rate'], '.0%')} | {eq} |"
            )
    lines += ["", "| protocol | SSD/SD | SSD/AR | SD/AR | physical bound on SSD/SD: 1 + draft/verify of SD | SSD/SD ÷ bound |", "|---|---|---|---|---|---|"]
    for proto, p in report["protocols"].items():
        r, b = p["ratios"], p["bound"]

        def ratio(key: str) -> str:
            v = r.get(key)
            return "–" if v is None else f"{_f(v['of_medians'], '.2f', '×')} (paired {_f(v['paired_median'], '.2f', '×')})"

        if b is None:
            bound = "–"
        elif "source" in b:
            bound = f"SSD ≤ {b['ssd_tok_per_s_max']:.1f} tok/s (from paper) = {b['ssd_over_sd_max']:.2f}× this SD"
        else:
            bound = (f"1 + {b['sd_draft_s_per_round'] * 1e3:.0f} ms / {b['sd_verify_s_per_round'] * 1e3:.0f} ms "
                     f"= {b['ssd_over_sd_max']:.2f}× (SSD ≤ {_f(b['ssd_tok_per_s_max'], '.1f')} tok/s)")
        lines.append(f"| {proto} | {ratio('ssd/sd')} | {ratio('ssd/ar')} | {ratio('sd/ar')} | {bound} | "
                     f"{_f(b['measured_over_bound'] if b else None, '.0%')} |")
    fams = sorted({f for p in report["protocols"].values() for m in p["modes"].values() for f in m["tok_per_s_by_family"]})
    if len(fams) > 1:
        lines += ["", "| protocol / mode | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
        for proto, p in report["protocols"].items():
            for mode, m in p["modes"].items():
                lines.append(f"| {proto} / {mode.upper()} | " + " | ".join(_f(m["tok_per_s_by_family"].get(f), ".1f") for f in fams) + " |")
    return "\n".join(lines) + "\n"
