"""The numbers the side panel shows, computed from :class:`~ssd_chat.engine.events.Stats` only.

Each figure names its source.  A speedup is *measured* when there is a measured decode rate of
the other mode on this hardware: a ``bench`` report given with ``--baseline``, else the latest
reply in this chat that ran in that mode (another prompt: the basis row says so), or, in a
comparison, the same prompt run in each mode.  Otherwise it is *estimated* from this reply's own
warm timings, or not shown (—) where there is no sound basis:

* this reply      = TTFT + verify_s + draft_s + wait_s   (the critical path)
* vs SD (est.)    = sd_estimate_s / this reply   (SSD, when the reply ends: the engine's TTFT + per round
                    verify + k warm draft steps, i.e. SD on the same rounds; the speculator times its
                    draft step after an untimed first call, so compiling is not charged to SD)
* vs AR           = measured only: AR's cost per token is a 1-row target step, which an SSD or SD
                    reply never runs (its k+1-row verify costs about two of them on the CPU kernels),
                    so without an AR rate measured on this machine it shows —
* vs X (measured) = this reply's tok/s / X's measured tok/s

Every speedup is checked against its physical bound (:mod:`ssd_chat.engine.metrics`): vs SD
1 + draft/verify of SD (of the SD run measured, else of this reply's SD estimate), vs AR the mean
accepted length.  A measured ratio above it is shown as noise (the machine was busy during one of
the runs); an estimate above it is not shown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...chat.stats import fmt, ran_as
from ...engine import Stats, over_ar_bound, ssd_over_sd_bound


@dataclass(frozen=True, slots=True)
class Baseline:
    """A measured decode rate for a mode on this hardware (a ``bench`` report, a reply, a comparison)."""

    mode: str  # "ar" | "sd" | "ssd"
    tok_per_s: float
    source: str  # e.g. "bench cpu.json (smollm2, equal)", "AR reply 2 (another prompt)"
    explicit: bool = False  # given by the user (--baseline): replies in the chat do not replace it
    ssd_bound: float | None = None  # an SD rate: 1 + draft/verify of that SD run, the most SSD can gain over it


MIN_BASELINE_TOKENS = 8  # a reply shorter than this has too few token gaps to be a decode rate


def baseline_from_reply(s: Stats, label: str, min_tokens: int = MIN_BASELINE_TOKENS) -> Baseline | None:
    """The decode rate of a finished reply as a measured baseline for later replies in other modes
    (``min_tokens=2`` for runs of the same prompt, whose lengths are the same)."""
    if s.tok_per_s is None or s.new_tokens < min_tokens or s.switched_after:
        return None  # a reply that switched modes half-way is no mode's baseline
    mode = ran_as(s)
    return Baseline(mode, s.tok_per_s, label, ssd_bound=ssd_over_sd_bound(s.draft_s, s.verify_s) if mode == "sd" else None)


@dataclass(frozen=True, slots=True)
class Speedup:
    value: float | None
    kind: str  # "measured" | "estimated" | "n/a"
    note: str = ""
    bound: float | None = None  # the physical bound on this ratio (None: not known)

    @property
    def noise(self) -> bool:
        """Above its physical bound: not a speedup but timing noise (a busy machine during one of the runs)."""
        return self.value is not None and self.bound is not None and self.value > self.bound


def critical_path_s(s: Stats) -> float | None:
    """TTFT + the time the rounds spent verifying, drafting on the critical path and waiting."""
    if s.verify_s is None:
        return None
    return (s.ttft_s if s.ttft_s is not None else s.prefill_s) + s.verify_s + (s.draft_s or 0.0) + (s.wait_s or 0.0)


def sd_draft_estimate_s(s: Stats) -> float | None:
    """What SD would have spent drafting this reply's rounds (the engine's estimate less its TTFT and verifies)."""
    if s.sd_estimate_s is None or s.verify_s is None:
        return None
    return s.sd_estimate_s - (s.ttft_s if s.ttft_s is not None else s.prefill_s) - s.verify_s


def bound_vs(s: Stats, baseline_mode: str, measured: Baseline | None = None) -> float | None:
    """The physical bound on this reply's speedup over ``baseline_mode``."""
    if baseline_mode == "ar":
        return over_ar_bound(s.mean_accepted_length)
    if measured is not None and measured.ssd_bound is not None:
        return measured.ssd_bound
    return ssd_over_sd_bound(sd_draft_estimate_s(s), s.verify_s)


def speedup_vs(s: Stats | None, baseline_mode: str, measured: Baseline | None = None) -> Speedup:
    """Speedup of this reply over ``baseline_mode`` ("ar" or "sd")."""
    if s is None:
        return Speedup(None, "n/a")
    mode = ran_as(s)
    if mode == baseline_mode or (baseline_mode == "sd" and mode == "ar"):
        return Speedup(None, "n/a", f"this reply is {mode.upper()}")
    bound = bound_vs(s, baseline_mode, measured)
    if measured is not None and measured.tok_per_s > 0 and s.tok_per_s is not None:
        return Speedup(s.tok_per_s / measured.tok_per_s, "measured", measured.source, bound)
    if baseline_mode == "ar":
        return Speedup(None, "n/a", "not measured")  # no 1-row target step on this machine to cost AR with
    crit = critical_path_s(s)
    if not crit or crit <= 0 or not s.rounds:
        return Speedup(None, "n/a", "no rounds yet")
    if s.sd_estimate_s is None:
        return Speedup(None, "n/a", "estimated when the reply ends")
    est = Speedup(s.sd_estimate_s / crit, "estimated", "from round timings", bound)
    return Speedup(None, "n/a", "estimate above its bound") if est.noise else est


def baselines_from_bench(path: str | Path) -> list[Baseline]:
    """Measured AR / SD decode rates from an ``ssd-chat bench --json`` report (median tok/s of its
    ``equal`` protocol, else its first)."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        protos = report["protocols"]
        proto = "equal" if "equal" in protos else next(iter(protos))
        p = protos[proto]
        target = report.get("models", {}).get("target", {}).get("name", "?")
        out = []
        for mode in ("ar", "sd"):
            m = p["modes"].get(mode) or {}
            med = m.get("tok_per_s", {}).get("median")
            bound = None
            if mode == "sd":  # the bench's own bound, else the same rule from its SD's draft/verify per round
                bound = (p.get("bound") or {}).get("ssd_over_sd_max") or ssd_over_sd_bound(m.get("draft_s_per_round"), m.get("verify_s_per_round"))
            if med:
                out.append(Baseline(mode, float(med), f"bench {path.name} ({target}, {proto})", explicit=True, ssd_bound=bound))
    except FileNotFoundError:
        raise ValueError(f"no bench report at {path}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, StopIteration) as e:
        raise ValueError(f"{path} is not an `ssd-chat bench --json` report ({type(e).__name__}: {e})") from None
    if not out:
        raise ValueError(f"{path} has no AR or SD tok/s to compare with")
    return out


def fmt_speedup(sp: Speedup) -> str:
    if sp.value is None:
        return "—"
    if sp.noise:  # only measured ratios get here: an estimate above its bound has no value
        return f"{sp.value:.2f}× noise (> bound {sp.bound:.2f}×)"
    return f"{sp.value:.2f}× {'meas.' if sp.kind == 'measured' else 'est.'}"


def basis(s: Stats | None, measured: dict[str, Baseline]) -> str:
    """Where the speedups come from, e.g. "AR: AR reply 2 (another prompt) · SD: estimate"."""
    parts = []
    for mode in ("ar", "sd"):
        sp = speedup_vs(s, mode, measured.get(mode))
        if sp.kind == "measured" or sp.note in ("not measured", "estimate above its bound"):
            parts.append(f"{mode.upper()}: {sp.note}")
        elif sp.kind == "estimated":
            parts.append(f"{mode.upper()}: estimate")
    return " · ".join(parts) or "—"


def panel_values(s: Stats | None, measured: dict[str, Baseline] | None = None) -> dict[str, str]:
    """The panel's figures as displayed strings, keyed by field name."""
    measured = measured or {}
    if s is None:
        return {k: "—" for k in ("tok_per_s", "ttft", "tau", "acceptance", "per_position", "cache_hit", "tau_hit_miss",
                                 "round_ms", "vs_sd", "vs_ar", "basis", "tokens")}
    per_round = (lambda v: None if v is None or not s.rounds else 1000 * v / s.rounds)  # noqa: E731
    return {
        "tok_per_s": fmt(s.tok_per_s, ".1f"),
        "ttft": fmt(s.ttft_s, ".2f", " s"),
        "tau": fmt(s.mean_accepted_length, ".2f"),
        "acceptance": fmt(s.acceptance_rate, ".1%"),
        "per_position": " ".join(f"{p:.0%}" for p in s.per_position_acceptance) if s.per_position_acceptance else "—",
        "cache_hit": fmt(s.cache_hit_rate, ".1%"),
        "tau_hit_miss": f"{fmt(s.accepted_length_on_hit, '.2f')} / {fmt(s.accepted_length_on_miss, '.2f')}",
        "round_ms": "—" if not s.rounds else " / ".join(
            [fmt(per_round(s.verify_s), ".0f"), fmt(per_round(s.draft_s), ".0f")] + ([fmt(per_round(s.wait_s), ".0f")] if s.wait_s is not None else [])),
        "vs_sd": fmt_speedup(speedup_vs(s, "sd", measured.get("sd"))),
        "vs_ar": fmt_speedup(speedup_vs(s, "ar", measured.get("ar"))),
        "basis": basis(s, measured),
        "tokens": f"{s.new_tokens} in {s.rounds} rounds" if s.rounds else f"{s.new_tokens}",
    }
