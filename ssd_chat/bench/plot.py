"""The bench report as a PNG: median decode tok/s per protocol and mode (with the draft bound), and per prompt family."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
    ratio_txt = [f"{proto}: " + ", ".join(f"{k.upper()} {v['of_medians']:.2f}×"
                                          for k, v in report["protocols"][proto]["ratios"].items() if v["of_medians"] is not None)
                 for proto in protos]
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
