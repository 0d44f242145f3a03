"""The one event stream every decoder yields and every consumer reads.

AR, SD and SSD all produce these frozen dataclasses; the TUI, ``ask``, ``bench``,
the recorder and the tests consume nothing else.  ``to_dict``/``from_dict``/``from_json``
give the JSONL form used by ``--record`` and ``demo --replay`` (pydantic, at that boundary only:
constructing an event validates nothing).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

DoneReason = Literal["eos", "stop", "length", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token, in output order."""

    id: int
    text: str  # the text delta this token released ("" while a character is incomplete)
    source: Literal["target", "draft"] = "target"  # "draft": an accepted draft token
    t_s: float = 0.0  # seconds since the request started


@dataclass(frozen=True, slots=True)
class Round:
    """One verification by the target (SD and SSD; AR emits none)."""

    index: int
    drafted: tuple[int, ...]  # the k draft tokens proposed this round
    accepted: int  # 0..k draft tokens accepted (bonus not included)
    bonus_id: int | None  # the target's own token after the accepted prefix (None if the reply ended first)
    emitted: int  # tokens this round actually added to the reply (<= accepted + 1)
    draft_s: float  # time spent drafting on the critical path (SD: all of it; SSD: fallback only)
    verify_s: float  # target forward + acceptance test
    t_s: float = 0.0  # seconds since the request started, at the end of this round
    # SSD only (None elsewhere)
    cache_hit: bool | None = None
    predicted: tuple[tuple[int, tuple[int, ...]], ...] | None = None  # ((j, (bonus candidates...)), ...)
    wait_s: float | None = None  # time the verifier waited for the speculator
    speculator_busy_s: float | None = None  # speculator's compute for this round (glue + tree)
    fallback: str | None = None  # "neural" | "fast" when this round's speculation came from a fallback


@dataclass(frozen=True, slots=True)
class Notice:
    """Something the user should see that is not an error (e.g. a fallback)."""

    message: str
    level: Literal["info", "warning"] = "info"
    t_s: float = 0.0
    # set when the reply goes on in another mode (SSD without its speculator: SD, or AR)
    mode: str | None = None
    after_round: int | None = None  # rounds finished in the original mode before the switch


@dataclass(frozen=True, slots=True)
class Stats:
    """Totals for one reply.  Figures a mode does not have are None."""

    mode: str
    new_tokens: int
    rounds: int
    elapsed_s: float
    prefill_s: float
    ttft_s: float | None
    tok_per_s: float | None  # decode rate: tokens after the first block / (t_last - t_first)
    acceptance_rate: float | None  # accepted draft tokens / drafted tokens
    mean_accepted_length: float | None  # tokens per verification, bonus included
    cache_hit_rate: float | None  # SSD: hits / rounds
    per_position_acceptance: tuple[float, ...] | None = None
    accepted_length_on_hit: float | None = None
    accepted_length_on_miss: float | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    wait_s: float | None = None
    sd_estimate_s: float | None = None  # SSD: what SD would have taken for the same rounds (estimate)
    ran_as: str | None = None  # the mode that produced the end of the reply, when not ``mode``
    switched_after: int | None = None  # rounds ``mode`` ran before it switched to ``ran_as``
    path: str | None = None  # the target's forwards: "compiled" graphs or "eager" kernels (fixed for the whole reply)

    @property
    def label(self) -> str:
        return mode_label(self.mode, self.ran_as, self.switched_after)


def mode_label(mode: str, ran_as: str | None = None, switched_after: int | None = None) -> str:
    """What produced a reply, for status lines and history: ``SSD``, ``SSD → SD after round 12``,
    or ``SD (not SSD)`` when the configured mode never ran."""
    if not ran_as or ran_as == mode:
        return mode.upper()
    if not switched_after:
        return f"{ran_as.upper()} (not {mode.upper()})"
    return f"{mode.upper()} → {ran_as.upper()} after round {switched_after}"


@dataclass(frozen=True, slots=True)
class Done:
    """The reply is over.  ``text`` and ``token_ids`` are the whole reply."""

    reason: DoneReason
    text: str
    token_ids: tuple[int, ...]
    stats: Stats


@dataclass(frozen=True, slots=True)
class Error:
    """The reply failed; ``text``/``token_ids`` hold what was produced before."""

    message: str
    kind: str = "runtime"
    text: str = ""
    token_ids: tuple[int, ...] = ()


Event = Union[Token, Round, Notice, Done, Error]

def _tag(v: Any) -> str:
    return v.get("type") if isinstance(v, dict) else type(v).__name__


@functools.cache
def codec() -> Any:
    """The pydantic TypeAdapter over the events, told apart by their ``type`` key.  Built on first use:
    importing pydantic costs a start that never records or replays."""
    from pydantic import Discriminator, Tag, TypeAdapter

    tagged = tuple(Annotated[c, Tag(c.__name__)] for c in (Token, Round, Notice, Done, Error))
    return TypeAdapter(Annotated[Union[tagged], Discriminator(_tag)])


def to_dict(ev: Event) -> dict[str, Any]:
    """JSON-ready dict with a ``type`` field."""
    return {**codec().dump_python(ev, mode="json"), "type": type(ev).__name__}


def from_dict(d: dict[str, Any]) -> Event:
    """Inverse of :func:`to_dict` (lists stand for tuples; unknown extra keys from newer versions are
    ignored); a pydantic ValidationError when a field is missing or of the wrong type."""
    return codec().validate_python(d)


def from_json(text: str | bytes) -> Event:
    """One event from its JSON text, strictly: an integer field takes no ``true`` or ``1.0``, a string
    field no number (what a recording holds must be what :func:`to_dict` wrote)."""
    return codec().validate_json(text, strict=True)


__all__ = ["Token", "Round", "Notice", "Stats", "Done", "Error", "Event", "codec", "to_dict", "from_dict", "from_json", "mode_label"]
