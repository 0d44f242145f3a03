"""Rewriting the end of a saved chat, for the app's regenerate and edit-and-rerun: drop the messages
after a point, and keep a copy of a chat before that (so an edit loses nothing the user wrote).

Kept apart from :mod:`ssd_chat.history` (the store); these use its write path, so a database that
fails mid-way degrades to memory as every other write does.
"""

from __future__ import annotations

import sqlite3
import time

from .history import History


def truncate(history: History, conversation_id: int, keep: int, expect: int | None = None) -> int | None:
    """Delete the chat's messages after its first ``keep`` (with their metrics); returns how many went.

    ``expect``: the number of messages the caller believes the chat has; when the saved chat has
    another number (an earlier write was lost), nothing is deleted and None is returned, so the
    saved chat never loses a message the screen does not show as dropped.  With ``keep == 0`` the
    chat's title goes back to "(new chat)": the next prompt names it again.
    """
    def go(db: sqlite3.Connection) -> int | None:
        ids = [r[0] for r in db.execute("SELECT id FROM messages WHERE conversation_id=? ORDER BY id", (conversation_id,))]
        if expect is not None and len(ids) != expect:
            return None
        drop = ids[keep:]
        db.executemany("DELETE FROM messages WHERE id=?", [(i,) for i in drop])  # turn_metrics: ON DELETE CASCADE
        db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (time.time(), conversation_id))
        if keep == 0:
            db.execute("UPDATE conversations SET title='(new chat)' WHERE id=?", (conversation_id,))
        return len(drop)

    return history._write(go)


def copy_conversation(history: History, conversation_id: int, title: str) -> int | None:
    """A new saved chat holding this one's messages (status, times) and metrics; its id.

    While the file is locked the copy is made in memory and saved later: it is saved with the ids it got
    here (the chat's and its messages'), so the id this returns is the one the saved copy has."""
    def go(db: sqlite3.Connection, ids: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
        row = db.execute("SELECT created_at FROM conversations WHERE id=?", (conversation_id,)).fetchone()
        if row is None:
            return None
        given = iter(ids or ())
        now = time.time()
        cur = db.execute(
            "INSERT INTO conversations(id, title, system, created_at, updated_at) "
            "VALUES (coalesce(?, (SELECT max(coalesce(max(id), 0), ?) + 1 FROM conversations)),?,NULL,?,?)",
            (next(given, None), history._max_id["conversations"], title, row[0], now),
        )
        got = [int(cur.lastrowid)]
        for mid, role, content, status, created in db.execute(
                "SELECT id, role, content, status, created_at FROM messages WHERE conversation_id=? ORDER BY id",
                (conversation_id,)).fetchall():
            c = db.execute(
                "INSERT INTO messages(id, conversation_id, role, content, status, created_at) "
                "VALUES (coalesce(?, (SELECT max(coalesce(max(id), 0), ?) + 1 FROM messages)),?,?,?,?,?)",
                (next(given, None), history._max_id["messages"], got[0], role, content, status, created),
            )
            got.append(int(c.lastrowid))
            db.execute(
                """INSERT INTO turn_metrics(message_id, mode, target, draft, new_tokens, tok_per_s, ttft_s,
                   mean_accepted_length, acceptance_rate, cache_hit_rate, stats_json)
                   SELECT ?, mode, target, draft, new_tokens, tok_per_s, ttft_s, mean_accepted_length, acceptance_rate,
                   cache_hit_rate, stats_json FROM turn_metrics WHERE message_id=?""",
                (got[-1], mid),
            )
        return tuple(got)

    ids = history._write(go, keeps_id=True)
    if not ids:
        return None
    history._seen("messages", max(ids[1:], default=None))
    return history._seen("conversations", ids[0])
