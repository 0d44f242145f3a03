"""The simulated race's report: a table, Markdown and a plot of SSD/SD against acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEAD = ("acceptance", "AR tok/s", "SD tok/s", "SSD tok/s", "SD/AR", "SSD/AR", "SSD/SD", "SSD/SD bound",
        "cache hits", "tokens/round", "overhead ms/round", "greedy = AR")


def rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    ar = report["ar"]["tok_per_s"]
    out = []
    for r in report["rows"]:
        sd, ssd, x = r["sd"], r["ssd"], r["ratios"]
        exact = "yes" if sd["greedy_equal_ar"] and ssd["greedy_equal_ar"] else "NO"
        out.append((f"{r['acceptance_asked']:.2f} (draft agrees {r['agreement_calibrated']:.2f})", f"{ar:.1f}",
                    f"{sd['tok_per_s']:.1f}", f"{ssd['tok_per_s']:.1f}", f"{x['sd_over_ar']:.2f}x", f"{x['ssd_over_ar']:.2f}x",
                    f"{x['ssd_over_sd']:.2f}x", f"{x['ssd_over_sd_bound']:.2f}x", f"{100 * ssd['cache_hit_rate']:.0f} %",
                    f"SD {sd['mean_accepted_length']:.2f}, SSD {ssd['mean_accepted_length']:.2f}",
                    f"SD {sd['overhead']['critical_path_overhead_ms']:.2f}, SSD {ssd['overhead']['critical_path_overhead_ms']:.2f}",
                    exact))
    return out


def overhead_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    """SSD's overhead per round, split (ms)."""
    keys = ("critical_path_overhead_ms", "verifier_python_ms", "sampling_and_verify_ms", "wait_beyond_model_ms",
            "speculator_python_ms")
    return [(f"{r['acceptance_asked']:.2f}", *(f"{r['ssd']['overhead'][k]:.2f}" for k in keys)) for r in report["rows"]]


OVERHEAD_HEAD = ("acceptance", "critical path", "verifier Python", "sampling + verify", "channel + late speculator",
                 "speculator Python (off the path)")


def header(report: dict[str, Any]) -> list[str]:
    p, paper = report["profile"], report["paper"]
    lines = [f"{report['label']}",
             f"profile {p['name']}: target {p['target']['step_ms']} ms per step (flat to {p['target']['flat_rows']} rows), "
             f"draft {p['draft']['step_ms']} ms, k = {report['k']}, fan-out {report['fan_out']}"
             + (", one device shared by target and draft" if p["shared_device"] else ", the draft on a device of its own"),
             f"AR {report['ar']['tok_per_s']:.1f} tok/s (bound {report['ar']['bound']:.1f}); the profile's acceptance: "
             f"{p['acceptance']} ({p['acceptance_source']})",
             f"models: {report['models']}; {report['prompts']} prompts x {report['max_new_tokens']} tokens, greedy"]
    if paper:
        lines.append(f"paper (measured on GPUs): AR {paper['ar']}, SD {paper['sd']}, SSD {paper['ssd']} tok/s: SD/AR "
                     f"{paper['sd_over_ar']:.2f}x, SSD/AR {paper['ssd_over_ar']:.2f}x, SSD/SD {paper['ssd_over_sd']:.2f}x")
    lines.append(f"overheads include the simulation's own {report['harness_ms_per_forward']:.3f} ms per padded forward "
                 "(waking up after the modelled time; measured with forwards that compute nothing)")
    if p["shared_device"]:
        lines.append("one device for both models: the verify waits for the speculator's forwards on it, so the split of the "
                     "SSD overhead between sampling + verify and the channel is not meaningful; the critical-path total is")
    over = {who: sum(t["overruns"] for t in ts.values()) for who, ts in report["padding"].items()}
    if any(over.values()):
        lines.append(f"warning: {sum(over.values())} forwards computed for longer than their modelled time "
                     f"({', '.join(f'{w}: {n}' for w, n in over.items() if n)}): those rounds ran slower than the profile")
    return lines


def print_report(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    for line in header(report):
        console.print(line, markup=False, highlight=False)
    t = Table(*HEAD, title=f"{report['profile']['name']} (simulated)")
    for r in rows(report):
        t.add_row(*r)
    console.print(t)
    o = Table(*OVERHEAD_HEAD, title="SSD overhead per round, ms (simulated)")
    for r in overhead_rows(report):
        o.add_row(*r)
    console.print(o)


def markdown(report: dict[str, Any]) -> str:
    def table(head: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]

    lines = [f"**{report['label']}**", ""] + [f"- {line}" for line in header(report)[1:]] + [""]
    lines += table(HEAD, rows(report)) + ["", "SSD overhead per round (ms):", ""] + table(OVERHEAD_HEAD, overhead_rows(report))
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """SSD/SD against acceptance: measured (simulated), the analytical bound, and the paper's point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r["acceptance_asked"] for r in report["rows"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["ratios"]["ssd_over_sd_bound"] for r in report["rows"]], "--", color="#888888", label="bound (at the measured hit rate)")
    ax.plot(xs, [r["ratios"]["ssd_over_sd"] for r in report["rows"]], "o-", color="#DD8452", label="SSD/SD, simulated run")
    paper = report["paper"]
    if paper:
        ax.plot([report["profile"]["acceptance"]], [paper["ssd_over_sd"]], "k*", markersize=12, label="paper (GPU measurement)")
    ax.axhline(1.0, color="#cccccc", linewidth=1)
    ax.set_xlabel("per-token acceptance asked (the draft's calibrated agreement with the target)")
    ax.set_ylabel("SSD / SD decode tok/s")
    ax.set_title(f"SIMULATED: {report['profile']['name']}, k = {report['k']}, fan-out {report['fan_out']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_plan(prof: Any, alphas: list[float], n_prompts: int, max_new: int, console: Any) -> None:
    """``bench --simulate --dry-run``: what the race would run, and the least time its padded forwards take."""
    from ..engine import simulate

    k, tokens = prof.k, n_prompts * max_new
    secs = tokens * prof.target.ms(1) / 1e3  # AR: one target step per token
    for a in alphas:
        per_round = (1 - a ** (k + 1)) / (1 - a)  # tokens a round emits at per-token acceptance a
        b = simulate.bounds(prof, per_round, k, 1.0)
        secs += tokens / b["sd"] + tokens / b["ssd_all_hits"]
    console.print(f"SIMULATED {prof.title} ({prof.name}): k={k}, fan-out {prof.fan_out}", highlight=False)
    console.print(f"AR once, then SD and SSD at acceptance {', '.join(f'{a:g}' for a in alphas)}: "
                  f"{n_prompts} prompt{'s' if n_prompts != 1 else ''} x {max_new} tokens each, on a random Llama and a draft calibrated to each acceptance", highlight=False)
    console.print(f"at least {secs:.0f} s of simulated forwards (the CPU's own work and the calibration come on top); "
                  "dry run: nothing was run", highlight=False)
