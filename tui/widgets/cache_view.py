"""The speculation-cache view: for the latest rounds, what the speculator pre-built and what the target chose."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from ...engine.events import Round


@dataclass(frozen=True, slots=True)
class CacheRow:
    index: int
    accepted: int  # j: draft tokens the target accepted
    bonus_id: int | None
    bonus_text: str
    hit: bool | None  # None outside SSD
    predicted: tuple[tuple[int, tuple[int, ...]], ...]  # ((j, candidate bonus ids), ...)
    fallback: str | None


def _show(text: str | None, token_id: int | None) -> str:
    if text is None:
        return "?" if token_id is None else f"#{token_id}"
    return repr(text)[1:-1] or "␀"


class CacheView(Static):
    """Latest rounds, newest first.  Hit: the target's outcome (j, bonus) was among the predictions."""

    def __init__(self, max_rows: int = 6, **kwargs) -> None:
        super().__init__(markup=False, **kwargs)
        self.rows: deque[CacheRow] = deque(maxlen=max_rows)
        self.token_text: Callable[[int], str | None] = lambda _id: None

    def on_mount(self) -> None:
        self._refresh_table()

    def add_rounds(self, rounds: list[tuple[Round, str | None]]) -> None:
        """``[(round, bonus token text or None), ...]``."""
        for r, bonus_text in rounds:
            text = bonus_text if bonus_text is not None else (self.token_text(r.bonus_id) if r.bonus_id is not None else None)
            self.rows.append(CacheRow(r.index, r.accepted, r.bonus_id, _show(text, r.bonus_id), r.cache_hit,
                                      tuple(r.predicted or ()), r.fallback))
        if rounds:
            self._refresh_table()

    def clear(self) -> None:
        self.rows.clear()
        self._refresh_table()

    def predicted_cell(self, row: CacheRow) -> Text:
        out = Text()
        if not row.predicted:
            out.append("— (no speculation cache)" if row.hit is None else "—", style="dim")
            return out
        for n, (j, cands) in enumerate(row.predicted):
            if n:
                out.append("  ")
            chosen_j = j == row.accepted
            out.append(f"{j}:", style="bold" if chosen_j else "dim")
            for c in cands:
                label = _show(self.token_text(c), c)
                if chosen_j and c == row.bonus_id:
                    out.append(f"[{label}]", style="bold reverse green")
                else:
                    out.append(f" {label}" if len(cands) > 1 else label, style=None if chosen_j else "dim")
        return out

    def _refresh_table(self) -> None:
        t = Table(expand=True, box=None, padding=(0, 1), show_edge=False)
        t.add_column("#", justify="right", no_wrap=True, style="dim")
        t.add_column("outcome", no_wrap=True)
        t.add_column("", no_wrap=True)
        t.add_column("predicted  j: bonus candidates", overflow="fold")
        for row in reversed(self.rows):
            verdict = Text("—", style="dim") if row.hit is None else (
                Text("hit", style="bold green") if row.hit else Text("miss", style="bold red"))
            if row.fallback:
                verdict.append(f" ({row.fallback})", style="dim")
            t.add_row(str(row.index), f"j={row.accepted} +{row.bonus_text}", verdict, self.predicted_cell(row))
        if not self.rows:
            t.add_row("", Text("no rounds yet", style="dim"), "", "")
        self.update(t)
