"""The speculation-cache view: for the latest rounds, what the speculator pre-built and what the target chose.

SSD semantics (``engine/decode/ssd.py``): while round r-1 is verified, the speculator caches drafts for
the outcomes it predicts, keyed ``(j accepted, bonus token)``; round r's ``predicted`` is that
set and ``cache_hit`` says whether round r-1's actual outcome was in it.  So each row pairs a
round's predictions with the *previous* round's outcome.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ...engine import Round


@dataclass(frozen=True, slots=True)
class CacheRow:
    index: int  # the round whose drafts came from (or missed) the cache
    hit: bool | None  # None outside SSD
    predicted: tuple[tuple[int, tuple[int, ...]], ...]  # ((j, candidate bonus ids), ...) cached for this round
    chosen_j: int | None  # the outcome the target chose in the previous round: j accepted ...
    chosen_id: int | None  # ... and its bonus token
    chosen_text: str
    accepted: int  # what this round then accepted
    fallback: str | None
    bonus_text: str = ""  # this round's own bonus token (shown for SD rounds, which have no cache)


class CacheView(Static):
    """Latest rounds, newest first: hit or miss, the outcome the target chose, the predicted outcomes."""

    def __init__(self, max_rows: int = 6, **kwargs) -> None:
        super().__init__(markup=False, **kwargs)
        self.rows: deque[CacheRow] = deque(maxlen=max_rows)
        self.token_text: Callable[[int], str | None] = lambda _id: None
        self._prev: tuple[Round, str | None] | None = None  # the previous round of this reply

    def _token(self, text: str | None, token_id: int | None) -> str:
        """A token as shown: ``text`` (None: looked up by ``token_id``), escaped."""
        if text is None and token_id is not None:
            text = self.token_text(token_id)
        if text is None:
            return "?" if token_id is None else f"#{token_id}"
        return repr(text)[1:-1] or "␀"

    def on_mount(self) -> None:
        self._refresh_table()

    def new_reply(self) -> None:
        """Rounds of a new reply do not continue the previous one's."""
        self._prev = None

    def add_rounds(self, rounds: list[tuple[Round, str | None]]) -> None:
        """``[(round, its bonus token's text or None), ...]`` in order."""
        for r, bonus_text in rounds:
            prev = self._prev
            if prev is not None and prev[0].index == r.index - 1:
                p, p_text = prev
                chosen = (p.accepted, p.bonus_id, self._token(p_text, p.bonus_id))
            else:
                chosen = (None, None, "—")
            self.rows.append(CacheRow(r.index, r.cache_hit, tuple(r.predicted or ()), *chosen, r.accepted, r.fallback,
                                      self._token(bonus_text, r.bonus_id)))
            self._prev = (r, bonus_text)
        if rounds:
            self._refresh_table()

    def clear(self) -> None:
        self.rows.clear()
        self._prev = None
        self._refresh_table()

    def predicted_cell(self, row: CacheRow) -> Text:
        """``j: candidates`` per predicted accepted length; the outcome the target chose is highlighted."""
        out = Text()
        if not row.predicted:
            out.append("no speculation cache (SD)" if row.hit is None else "nothing cached (first round or fallback)", style="dim")
            return out
        for n, (j, cands) in enumerate(row.predicted):
            if n:
                out.append(" │ ", style="dim")
            is_j = j == row.chosen_j
            out.append(f"{j}:", style="bold" if is_j else "dim")
            for m, c in enumerate(cands):
                if m:
                    out.append(" ")
                label = self._token(None, c)
                if is_j and c == row.chosen_id:
                    out.append(label, style="bold reverse green")
                else:
                    out.append(label, style=None if is_j else "dim")
        return out

    def _refresh_table(self) -> None:
        t = Table(expand=True, box=None, padding=(0, 1), show_edge=False, show_header=False)
        t.add_column("round", no_wrap=True)
        for row in reversed(self.rows):
            line = Text()
            line.append(f"#{row.index:<4}", style="dim")
            if row.hit is None:  # SD: no cache, just this round's outcome
                line.append("—    ", style="dim")
                line.append(f"accepted {row.accepted} + ")
                line.append(row.bonus_text, style="bold")
            else:
                line.append("hit  " if row.hit else "miss ", style="bold green" if row.hit else "bold red")
                if row.chosen_j is not None:
                    line.append(f"target chose j={row.chosen_j} + ")
                    line.append(row.chosen_text, style="bold")
                else:
                    line.append("first round", style="dim")
                line.append(f" → accepted {row.accepted}", style="dim")
            if row.fallback:
                line.append(f" ({row.fallback} fallback)", style="dim")
            line.append("\n      ")
            line.append_text(self.predicted_cell(row))
            t.add_row(line)
        if not self.rows:
            t.add_row(Text("no rounds yet: SD and SSD rounds show here, AR makes none", style="dim"))
        self.update(t)
