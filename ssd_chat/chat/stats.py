"""A finished reply's figures as text, for ``ask --stats``, the demo, ``compare`` and the app's panel.

Read off :class:`~ssd_chat.engine.events.Stats` only; no UI imports, so ``ask`` stays light.
"""

from __future__ import annotations

from ..engine import Stats

# what `ask --json` shows, the same whether the reply came from the models loaded here or from a `serve`
SAMPLING_SHOWN = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed")
STATS_SHOWN = ("new_tokens", "rounds", "tok_per_s", "ttft_s", "acceptance_rate", "mean_accepted_length", "cache_hit_rate",
               "path")  # path: "compiled" graphs or "eager" kernels, for the whole reply


def ran_as(s: Stats) -> str:
    """The mode that produced this reply (its end, when it switched): what its figures and labels must name."""
    return s.ran_as or s.mode


def fmt(v: float | None, spec: str, suffix: str = "", na: str = "—") -> str:
    return na if v is None else format(v, spec) + suffix


def format_stats(s: Stats) -> str:
    """One line for a finished reply (``ask --stats``, the demo): mode, tokens, tok/s, TTFT, acceptance, hits."""
    parts = [f"{s.label.lower()}: {s.new_tokens} token{'' if s.new_tokens == 1 else 's'}", f"{fmt(s.tok_per_s, '.1f', na='n/a')} tok/s",
             f"TTFT {fmt(s.ttft_s, '.2f', na='n/a')} s"]
    if s.mean_accepted_length is not None:
        parts += [f"accepted length {s.mean_accepted_length:.2f}", f"acceptance {fmt(s.acceptance_rate, '.0%', na='n/a')}"]
    if s.cache_hit_rate is not None:
        parts.append(f"cache hits {s.cache_hit_rate:.0%}")
    return ", ".join(parts)
