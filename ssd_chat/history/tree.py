"""Conversation branches: a saved chat is a tree of messages, and one path through it is the chat.

Each message has a ``parent_id`` (None: a first message) and an ``active`` flag: among the children of
one message, the active one (the newest when several say so, or none does) continues the current
branch.  Regenerate adds a reply beside the old one (same parent), an edit adds a user message beside
the edited one; the new one becomes active, so the old branch is kept, one switch away.

Siblings are counted as the user sees them: system prompts are not shown as messages, so two messages
are siblings when their nearest non-system ancestor is the same (a regenerate that re-applies a system
prompt set after the old reply starts its branch with that prompt).

These are pure functions over rows ``(id, parent_id, active, role)`` ordered by id, used by
:class:`~ssd_chat.history.store.History` for reading and inside its writes.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

Row = tuple[int, Any, Any, str]  # id, parent_id, active, role


def _children(rows: Sequence[Row]) -> dict[int | None, list[Row]]:
    ids = {r[0] for r in rows}
    kids: dict[int | None, list[Row]] = defaultdict(list)
    for r in rows:
        kids[r[1] if r[1] in ids else None].append(r)  # a parent that is gone: a first message
    return kids


def current_path(rows: Sequence[Row]) -> list[int]:
    """The ids of the current branch, first to last."""
    kids, path, node = _children(rows), [], None
    seen: set[int] = set()
    while (options := kids.get(node)) and node not in seen:
        seen.add(node)  # type: ignore[arg-type]
        active = [r for r in options if r[2]]
        node = max(active or options)[0]
        path.append(node)
    return path


def _visible_parent(by_id: dict[int, Row], row: Row) -> int | None:
    parent = by_id.get(row[1])
    while parent is not None and parent[3] == "system":
        parent = by_id.get(parent[1])
    return None if parent is None else parent[0]


def sibling_groups(rows: Sequence[Row]) -> dict[int, list[int]]:
    """For each message that is not a system prompt: its siblings' ids (itself included), oldest first."""
    by_id = {r[0]: r for r in rows}
    groups: dict[int | None, list[int]] = defaultdict(list)
    of: dict[int, int | None] = {}
    for r in rows:
        if r[3] != "system":
            of[r[0]] = vp = _visible_parent(by_id, r)
            groups[vp].append(r[0])
    return {i: sorted(groups[vp]) for i, vp in of.items()}


def positions(rows: Sequence[Row]) -> dict[int, tuple[int, int]]:
    """Message id -> (its position among its siblings from 1, their number), for those with siblings."""
    return {i: (g.index(i) + 1, len(g)) for i, g in sibling_groups(rows).items() if len(g) > 1}


def rows_of(db: sqlite3.Connection, conversation_id: int) -> list[Row]:
    return db.execute("SELECT id, parent_id, active, role FROM messages WHERE conversation_id=? ORDER BY id",
                      (conversation_id,)).fetchall()


def make_active(db: sqlite3.Connection, conversation_id: int, rows: Sequence[Row], message_id: int) -> None:
    """Make ``message_id`` (and the system prompts between it and its visible parent) the current branch there."""
    by_id = {r[0]: r for r in rows}
    node = by_id.get(message_id)
    while node is not None:
        db.execute("UPDATE messages SET active = (id = ?) WHERE conversation_id=? AND parent_id IS ?",
                   (node[0], conversation_id, node[1] if node[1] in by_id else None))
        parent = by_id.get(node[1])
        node = parent if parent is not None and parent[3] == "system" else None


def step(rows: Sequence[Row], message_id: int, by: int) -> int | None:
    """The sibling ``by`` places from ``message_id`` (-1: the one before), or None past either end."""
    group = sibling_groups(rows).get(message_id, [message_id])
    i = group.index(message_id) + by
    return group[i] if 0 <= i < len(group) and by else None
