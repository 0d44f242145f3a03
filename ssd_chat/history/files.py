"""The chat history's file, when it will not simply open or take a write: read-only opening, and the
writes held back while another program has it locked.

Reading commands (``chats list``/``show``/``export``) open the file read-only, so a read-only folder or a
full disk (where SQLite cannot make WAL's ``-shm`` file) does not stop them.  A write that finds the file
locked (or the disk full) is kept, in order, and replayed in one transaction once the file takes writes
again, with the ids the chat already uses.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .schema import migrate

Op = Callable[[sqlite3.Connection], Any]


def read_only_connection(path: Path, timeout_s: float) -> sqlite3.Connection:
    """``path`` opened read-only.  Where SQLite cannot make the ``-shm`` file (a read-only folder, a full
    disk) it is opened as immutable, which is safe only while no write-ahead log holds newer changes: with
    one there (another program has the file open), the error is raised instead of showing stale chats."""
    uri = path.resolve().as_uri()
    db = sqlite3.connect(uri + "?mode=ro", uri=True, timeout=timeout_s, check_same_thread=False)
    try:
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return db
    except sqlite3.OperationalError as e:
        db.close()
        wal = Path(str(path) + "-wal")
        if transient(e) or (wal.exists() and wal.stat().st_size > 0):
            raise
    db = sqlite3.connect(uri + "?mode=ro&immutable=1", uri=True, check_same_thread=False)
    db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return db


def transient(e: BaseException) -> bool:
    """Whether a failed write may well succeed later (another program's lock, a full disk)."""
    msg = str(e)
    return "locked" in msg or "busy" in msg or "full" in msg


class Pending:
    """Writes made while the file would not take them, to replay there in order; retried with a
    back-off (``first_s``, doubling up to ``max_s``) so a locked file costs the chat no waiting."""

    def __init__(self, first_s: float = 0.5, max_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ops: list[Op] = []
        self.clock = clock
        self.wait_s, self.max_s = first_s, max_s
        self.due = clock() + first_s

    def add(self, op: Op) -> None:
        self.ops.append(op)

    def is_due(self) -> bool:
        return self.clock() >= self.due

    def replay(self, db: sqlite3.Connection) -> None:
        """All the held writes in one transaction on ``db``, or none (raises)."""
        db.execute("BEGIN IMMEDIATE")
        try:
            for op in self.ops:
                op(db)
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def backoff(self) -> None:
        self.wait_s = min(self.wait_s * 2, self.max_s)
        self.due = self.clock() + self.wait_s


def chats_sql(raw: bool, where: str = "") -> str:
    """Chats with their message counts (system prompts are not counted); ``raw``: titles as bytes."""
    title = "CAST(c.title AS BLOB)" if raw else "c.title"
    return f"""SELECT c.id, {title}, c.created_at, c.updated_at, count(CASE WHEN m.role != 'system' THEN 1 END)
               FROM conversations c LEFT JOIN messages m ON m.conversation_id = c.id {where}
               GROUP BY c.id ORDER BY c.updated_at DESC, c.id DESC"""


def check_readable(db: sqlite3.Connection) -> None:
    """Raise unless the list of chats reads to its end, as ``chats list`` and Ctrl+R read it.  The app
    writes only to a file that passes (a damaged table can take a new row and then hide it, and every
    other chat, from the list); the ``chats`` commands refuse one that fails, whatever they were asked."""
    db.execute(chats_sql(raw=True)).fetchall()


def memory() -> sqlite3.Connection:
    """An empty store in memory."""
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("PRAGMA foreign_keys = ON")
    migrate(db)
    return db


def copy_to_memory(source: sqlite3.Connection | None, path: Path, timeout_s: float) -> tuple[sqlite3.Connection, bool]:
    """The file's contents in memory, read through ``source`` (closed here) or a read-only connection:
    a reader still gets past another program's write lock, and a read-only file can still be resumed.
    When the file cannot be read, an empty store; the flag says which."""
    mem = sqlite3.connect(":memory:", check_same_thread=False)
    try:
        if source is None:
            source = read_only_connection(path, timeout_s)
        # Take the read lock first, within the busy timeout: backup() itself retries a locked
        # file forever.  Holding it, the copy cannot be locked out half-way.
        source.execute("BEGIN")
        source.execute("SELECT count(*) FROM sqlite_master").fetchone()
        source.backup(mem)
        mem.execute("PRAGMA foreign_keys = ON")
        migrate(mem)
        for table in ("conversations", "messages", "turn_metrics"):  # a copy we can write to
            mem.execute(f"SELECT count(*) FROM {table}").fetchone()
        check_readable(mem)
        return mem, True
    except (sqlite3.Error, OSError, ValueError):
        mem.close()
        return memory(), False
    finally:
        if source is not None:
            with contextlib.suppress(sqlite3.Error):
                source.close()


def reason(e: BaseException) -> str:
    """A SQLite failure in a few words (never the stored text some messages quote)."""
    msg = str(e) or type(e).__name__
    if msg.startswith("Could not decode to UTF-8"):  # the message goes on with the stored text itself
        column = re.search(r"column '(\w+)'", msg)
        return "a saved text is not valid UTF-8" + (f" (column {column.group(1)})" if column else "")
    if "not a database" in msg or "malformed" in msg:
        return f"the file is corrupt ({msg})"
    if "locked" in msg:
        return f"another program has it locked ({msg})"
    return msg
