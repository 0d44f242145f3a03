"""The live side panel: what runs where, and how well speculation is going (this reply)."""

from __future__ import annotations

from collections import Counter, deque

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from ...engine import Round, Stats
from ...chat.terminal import printable
from .figures import Baseline, panel_values

LABELS = [
    ("tok_per_s", "tok/s", "decode rate: tokens after the first block / (t_last - t_first)"),
    ("ttft", "TTFT", "time to first token"),
    ("tau", "τ accepted len", "1 + accepted / rounds (bonus included)"),
    ("acceptance", "acceptance", "accepted draft tokens / drafted"),
    ("per_position", "per position", "acceptance of draft position 1, 2, … over the rounds that drafted it"),
    ("cache_hit", "cache hits", "SSD: rounds whose outcome was pre-speculated / rounds"),
    ("tau_hit_miss", "τ hit / miss", "mean accepted length on cache hits / misses"),
    ("round_ms", "verify/draft/wait", "ms per round: target verification / drafting on the critical path / SSD wait"),
    ("vs_sd", "vs SD", "speedup over plain speculative decoding"),
    ("vs_ar", "vs AR", "speedup over autoregressive decoding"),
    ("basis", "basis", "measured: the other mode's decode rate on this machine (whose); estimate: from this reply's round timings"),
    ("tokens", "tokens", "tokens this reply, verification rounds"),
]


class MetricsPanel(Vertical):
    """Mode and devices, the figures of :func:`ssd_chat.tui.widgets.figures.panel_values`, and accepted-length pictures."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.info: dict = {}
        self.stats: Stats | None = None
        self.values: dict[str, str] = panel_values(None)
        self.measured: dict[str, Baseline] = {}
        self.accepted_lengths: deque[int] = deque(maxlen=60)  # accepted + 1 per round, latest last
        self.histogram: Counter[int] = Counter()
        self.live = False
        self._figures_height: int | None = None  # lines the figures took when last drawn

    def compose(self) -> ComposeResult:
        yield Static(id="setup", markup=False)
        yield Static(id="figures", markup=False)
        yield Static("accepted length per round", classes="caption")
        yield Sparkline([], id="sparkline")
        yield Static(id="histogram", markup=False)

    def on_mount(self) -> None:
        # is_mounted turns true only after this handler: draw once it has, or the panel stays blank until a reply
        self.call_after_refresh(self._render_setup)
        self.call_after_refresh(self._render_figures)

    # -- inputs --------------------------------------------------------------------------
    def set_info(self, info: dict) -> None:
        self.info = dict(info)
        self._render_setup()

    def set_measured(self, baseline: Baseline) -> None:
        """A measured decode rate on this hardware; one the user gave (--baseline) is kept over replies'."""
        old = self.measured.get(baseline.mode)
        if old is None or baseline.explicit or not old.explicit:
            self.measured[baseline.mode] = baseline
        self.values = panel_values(self.stats, self.measured)
        self._render_figures()

    def forget_replies(self) -> None:
        """A new chat: rates measured on this chat's replies no longer apply to "this chat"."""
        self.measured = {m: b for m, b in self.measured.items() if b.explicit}

    def add_rounds(self, rounds: list[Round]) -> None:
        for r in rounds:
            self.accepted_lengths.append(r.accepted + 1)
            self.histogram[r.accepted + 1] += 1
        if rounds:
            self._render_pictures()

    def show(self, stats: Stats | None, live: bool, measured: dict[str, Baseline] | None = None) -> None:
        """``measured``: baselines for this display only (a comparison's runs of the same prompt)."""
        self.stats, self.live = stats, live
        self.values = panel_values(stats, {**self.measured, **(measured or {})})
        self._render_figures()

    # -- rendering -----------------------------------------------------------------------
    def _render_setup(self) -> None:
        i = self.info
        t = Table.grid(padding=(0, 1))
        t.add_column(style="bold", no_wrap=True)
        t.add_column()
        mode = i.get("mode_label") or (i.get("mode") or "?").upper()
        if i.get("auto"):  # auto's choice for this machine; the why line says how it was made
            mode = f"auto → {mode}"
        if i.get("k"):
            mode += f"  k={i['k']}"
        if i.get("fan_out"):
            mode += f"  fan-out {i['fan_out']}"
        if i.get("replay"):
            mode += "  (replay)"
        # model names and devices come from the user (paths, hub ids): Text, so Rich reads no markup in them
        t.add_row("mode", Text(printable(mode)))
        if i.get("simulated"):  # a recording made on simulated hardware: never to be read as a measurement
            slow = f", {i['time_scale']:g}x slow motion" if (i.get("time_scale") or 1) != 1 else ""
            t.add_row("hardware", Text(printable(f"SIMULATED {i['simulated']} (real models, forwards padded{slow})"), style="bold yellow"))
        if i.get("mode_reason"):
            t.add_row("why", Text(printable(i["mode_reason"]), style="dim"))
        t.add_row("target", Text(printable(f"{i.get('target') or '?'}" + (f" @ {i['target_device']}" if i.get("target_device") else ""))))
        if i.get("draft"):
            t.add_row("draft", Text(printable(f"{i['draft']}" + (f" @ {i['draft_device']}" if i.get("draft_device") else ""))))
        if i.get("forward"):  # which forward runs the models: the compact core (eager/compiled) or transformers
            fwd = i["forward"] if i.get("draft_forward") in (None, i["forward"]) else f"target {i['forward']}, draft {i['draft_forward']}"
            t.add_row("forward", Text(printable(fwd)))
        if i.get("compiling"):  # "compiling <model> for 3 rows in the background, 40%": replies run eagerly meanwhile
            t.add_row("compile", Text(printable(i["compiling"].removeprefix("compiling ")), style="dim"))
        if i.get("sampling") is not None:
            t.add_row("sampling", Text(sampling_line(i["sampling"])))
        elif i.get("temperature") is not None:  # a recording made before the sampling line
            t.add_row("temp", f"{i['temperature']:g}")
        if self.is_mounted:
            self.query_one("#setup", Static).update(t)

    def _render_figures(self) -> None:
        t = Table.grid(padding=(0, 1))
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        for key, label, _ in LABELS:
            t.add_row(label, self.values[key])
        state = "streaming…" if self.live else ("last reply" if self.stats else "no reply yet")
        t.add_row(Text("", style="dim"), Text(state, style="dim italic"))
        if self.is_mounted:
            # A layout of the whole screen costs more than the rest of a frame: only when the height changes.
            fig = self.query_one("#figures", Static)
            width = fig.content_region.width
            height = len(self.app.console.render_lines(t, self.app.console.options.update_width(width))) if width else None
            fig.update(t, layout=height is None or height != self._figures_height)
            self._figures_height = height
            self.set_class(self.live, "-live")

    def _render_pictures(self) -> None:
        if not self.is_mounted:
            return
        self.query_one("#sparkline", Sparkline).data = list(self.accepted_lengths)
        total = sum(self.histogram.values()) or 1
        width = 16
        lines = Text()
        for n in range(1, max(self.histogram) + 1):
            c = self.histogram.get(n, 0)
            lines.append(f"{n:>2} ", style="bold")
            lines.append("█" * round(width * c / total), style="cyan")
            lines.append(f" {c}\n", style="dim")
        self.query_one("#histogram", Static).update(lines)

    def reset(self) -> None:
        self.accepted_lengths.clear()
        self.histogram.clear()
        self.show(None, False)
        if self.is_mounted:
            self.query_one("#sparkline", Sparkline).data = []
            self.query_one("#histogram", Static).update("")


def sampling_line(s: dict) -> str:
    """``greedy`` or ``T 0.8 · top-p 0.9 · top-k 40``, then the penalties that are on."""
    parts = ["greedy" if not s.get("temperature") else f"T {s['temperature']:g}"]
    if s.get("temperature"):
        if s.get("top_p", 1.0) < 1.0:
            parts.append(f"top-p {s['top_p']:g}")
        if s.get("top_k"):
            parts.append(f"top-k {s['top_k']}")
    for key, label, off in (("repetition_penalty", "rep", 1.0), ("frequency_penalty", "freq", 0.0), ("presence_penalty", "pres", 0.0)):
        if s.get(key, off) != off:
            parts.append(f"{label} {s[key]:g}")
    return " ".join(parts)
