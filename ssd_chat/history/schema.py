"""The chat history's SQLite schema: append-only migrations, each run once, in order, tracked by
``PRAGMA user_version``.  A new column or table is a new ``m00N_*`` function at the end of
:data:`MIGRATIONS`; an existing one never changes (databases in the field have run it)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable


def m001_initial(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE conversations (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL,
            system TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        )"""
    )
    db.execute(
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at REAL NOT NULL
        )"""
    )
    db.execute("CREATE INDEX messages_by_conversation ON messages(conversation_id, id)")


def m002_reply_status(db: sqlite3.Connection) -> None:
    # streaming | done | stopped | error: a reply cut short keeps its text with its status
    db.execute("ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'done'")


def m003_turn_metrics(db: sqlite3.Connection) -> None:
    db.execute(
        """CREATE TABLE turn_metrics (
            message_id INTEGER PRIMARY KEY REFERENCES messages(id) ON DELETE CASCADE,
            mode TEXT,
            target TEXT,
            draft TEXT,
            new_tokens INTEGER,
            tok_per_s REAL,
            ttft_s REAL,
            mean_accepted_length REAL,
            acceptance_rate REAL,
            cache_hit_rate REAL,
            stats_json TEXT NOT NULL
        )"""
    )


def m004_system_turns(db: sqlite3.Connection) -> None:
    # The system prompt is a message (role 'system') where it was set: it applies to the replies after it.
    # A chat's old chat-wide prompt becomes its first message; messages are ordered by id, so it gets
    # id -<chat id>, below every id the chat has (new ids stay max(id) + 1).  '' marks "cleared".
    db.execute(
        """INSERT INTO messages(id, conversation_id, role, content, status, created_at)
           SELECT -id, id, 'system', system, 'done', created_at FROM conversations WHERE system IS NOT NULL AND system != ''"""
    )
    db.execute("UPDATE conversations SET system = NULL")


def m005_branches(db: sqlite3.Connection) -> None:
    # A chat is a tree (ssd_chat/history/tree.py): each message follows its parent, and ``active`` picks
    # the current branch among a message's children.  A chat saved before is one branch: each message
    # follows the one before it.
    if "parent_id" in {r[1] for r in db.execute("PRAGMA table_info(messages)")}:
        return  # a file whose version was set back by hand: its tree stays
    db.execute("ALTER TABLE messages ADD COLUMN parent_id INTEGER")
    db.execute("ALTER TABLE messages ADD COLUMN active INTEGER NOT NULL DEFAULT 1")
    db.execute(
        """UPDATE messages SET parent_id = (SELECT max(p.id) FROM messages p
           WHERE p.conversation_id = messages.conversation_id AND p.id < messages.id)"""
    )
    db.execute("CREATE INDEX messages_by_parent ON messages(conversation_id, parent_id)")


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [m001_initial, m002_reply_status, m003_turn_metrics,
                                                          m004_system_turns, m005_branches]


def migrate(db: sqlite3.Connection) -> int:
    """Apply the migrations this database has not seen; returns the schema version."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > len(MIGRATIONS):
        raise sqlite3.DatabaseError(f"schema version {version} is newer than this ssd-chat understands ({len(MIGRATIONS)})")
    for i, step in enumerate(MIGRATIONS[version:], start=version + 1):
        with db:
            step(db)
            db.execute(f"PRAGMA user_version = {i}")
    return len(MIGRATIONS)
