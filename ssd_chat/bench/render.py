"""The bench report shown: Rich tables on the terminal, Markdown tables for a document."""

from __future__ import annotations

from typing import Any


def _f(v: float | None, spec: str, suffix: str = "") -> str:
    return "–" if v is None else format(v, spec) + suffix


def _vs_ar(exact: dict[str, Any], mode: str, ref: str) -> tuple[str, bool | None]:
    """A mode's "greedy = AR" cell, "identical/compared" ("n/a" unchecked, ``ref`` for AR itself), and
    whether every compared reply was identical (None where nothing was compared)."""
    if not exact["checked"]:
        return "n/a", None
    if mode == "ar":
        return ref, None
    e = exact["modes"].get(mode, {})
    return f"{e.get('identical')}/{e.get('compared')}", e.get("compared") == e.get("identical")


def sampling_text(s: dict[str, Any]) -> str:
    """"greedy" or "temperature 0.8", then any penalty that is on ("repetition penalty 1.1")."""
    parts = ["greedy" if s["temperature"] == 0 else f"temperature {s['temperature']}"]
    parts += [f"{name.replace('_', ' ')} {s[name]}" for name, off in
              (("repetition_penalty", 1.0), ("frequency_penalty", 0.0), ("presence_penalty", 0.0)) if s.get(name, off) != off]
    return ", ".join(parts)


def render(report: dict[str, Any], console: Any) -> None:
    """Rich tables, one per protocol, each followed by its ratios, bounds and exactness."""
    from rich.table import Table

    models = report["models"]
    s = report["settings"]
    console.print(
        f"[bold]ssd-chat bench[/]: target [cyan]{models['target']['name']}[/], draft [cyan]{models['draft']['name'] if models.get('draft') else '–'}[/], "
        f"k={s['k']}, {s['max_new_tokens']} new tokens{' (EOS ignored)' if s['ignore_eos'] else ''}, "
        f"{sampling_text(s)}, "
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
            eq, same = _vs_ar(exact, mode, "ref")
            if same is not None:
                eq = f"[green]{eq}[/]" if same else f"[bold red]{eq}[/]"
            table.add_row(
                mode, _f(t["median"], ".1f"), f"{_f(t['p25'], '.1f')}–{_f(t['p75'], '.1f')}", f"{_f(t['min'], '.1f')}–{_f(t['max'], '.1f')}",
                _f(m["ttft_s"]["median"], ".3f"), _f(m["mean_accepted_length"], ".2f"), _f(m["acceptance_rate"], ".0%"),
                _f(m["cache_hit_rate"], ".0%"), f"{m['runs'] - m['failed']}" + (f" [red]({m['failed']} failed)[/]" if m["failed"] else ""), eq,
            )
        console.print(table)
        parts = [f"{key.upper()} {_f(r['of_medians'], '.2f', '×')} (paired {_f(r['paired_median'], '.2f', '×')})"
                 for key, r in p["ratios"].items()]
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
        mb = p.get("memory_bound")
        if mb and mb["modes"]:
            console.print(f"  memory bound ({mb['weight_bytes'] / 1e6:.0f} MB of target weights read per forward): " + "; ".join(
                f"{mode.upper()} ≤ {b['tok_per_s_max']:.1f} tok/s at {b['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s "
                f"(forward ≥ {b['forward_s_min'] * 1e3:.1f} ms; measured {_f(b['measured_over_bound'], '.0%')})"
                for mode, b in mb["modes"].items()))
    if report.get("channel_round_trip_ms") is not None:
        console.print(f"SSD channel round trip (verifier ⇄ speculator, median of 200): {report['channel_round_trip_ms']:.3f} ms")
    console.print("[dim]tok/s: decode rate per reply (median, IQR, range); TTFT: median; acc. len: mean accepted length (bonus "
                  "included); accept: acceptance rate; hits: SSD cache-hit rate; = AR: greedy replies identical to AR's[/]")
    fams = sorted({f for p in report["protocols"].values() for m in p["modes"].values() for f in m["tok_per_s_by_family"]})
    if len(fams) > 1:
        table = Table("protocol / mode", title="median decode tok/s by prompt family", title_justify="left")
        for f in fams:
            table.add_column(f, justify="right")
        for proto, p in report["protocols"].items():
            for mode, m in p["modes"].items():
                table.add_row(f"{proto} / {mode}", *(_f(m["tok_per_s_by_family"].get(f), ".1f") for f in fams))
        console.print(table)


def markdown(report: dict[str, Any]) -> str:
    """The summary as Markdown tables: one row per protocol and mode, then ratios and the two bounds."""
    s, models = report["settings"], report["models"]
    lines = [
        f"Target `{models['target']['name']}`, draft `{models['draft']['name'] if models.get('draft') else '–'}`, k={s['k']}, "
        f"{s['max_new_tokens']} new tokens per reply{' (EOS ignored)' if s['ignore_eos'] else ''}, "
        f"{sampling_text(s)}, {s['prompts']['count']} prompts "
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
            eq, _ = _vs_ar(ex, mode, "reference")
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
    bounds = [(proto, mode, b, p["memory_bound"]["weight_bytes"]) for proto, p in report["protocols"].items()
              if p.get("memory_bound") for mode, b in p["memory_bound"]["modes"].items()]
    if bounds:
        lines += ["", "| protocol | mode | target weights | read bandwidth | forward ≥ | memory bound on decode tok/s | measured ÷ bound |",
                  "|---|---|---|---|---|---|---|"]
        for proto, mode, b, w in bounds:
            lines.append(f"| {proto} | {mode.upper()} | {w / 1e6:.0f} MB | {b['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s | "
                         f"{b['forward_s_min'] * 1e3:.1f} ms | {b['tok_per_s_max']:.1f} | {_f(b['measured_over_bound'], '.0%')} |")
    fams = sorted({f for p in report["protocols"].values() for m in p["modes"].values() for f in m["tok_per_s_by_family"]})
    if len(fams) > 1:
        lines += ["", "| protocol / mode | " + " | ".join(fams) + " |", "|---|" + "---|" * len(fams)]
        for proto, p in report["protocols"].items():
            for mode, m in p["modes"].items():
                lines.append(f"| {proto} / {mode.upper()} | " + " | ".join(_f(m["tok_per_s_by_family"].get(f), ".1f") for f in fams) + " |")
    return "\n".join(lines) + "\n"
