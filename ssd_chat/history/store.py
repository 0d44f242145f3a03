"""Chat history in SQLite: conversations, messages and per-turn metrics.

The database is ``$SSD_CHAT_DATA_DIR/history.db`` (default ``$XDG_DATA_HOME/ssd-chat/history.db``,
i.e. ``~/.local/share/ssd-chat/history.db``), or the path given with ``--db``.

Schema changes are append-only ``m00N_*`` functions (:mod:`ssd_chat.history.schema`), applied once
each and tracked by ``PRAGMA user_version``.  A database that cannot be opened (corrupt, locked,
unwritable) never stops the chat: :class:`History` falls back to an in-memory database and sets
``warning`` to a sentence the app shows.  Corrupt includes a list of chats that does not read to its
end, checked before any write (:func:`~ssd_chat.history.files.check_readable`).  A write that fails later does the same, on an in-memory copy of the file
when it can still be read, so the current chat goes on with the same ids.  When the failure may pass
(another program's lock, a full disk), the writes made meanwhile are kept and saved to the file, in order,
once it takes them again (:mod:`ssd_chat.history.files`); ``resumed`` then says so, once.  A read that
fails (damaged pages) raises :class:`HistoryError` with a one-line reason; the rest stays usable.
``History(path, read_only=True)`` only reads (the ``chats`` commands that show chats).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import export as history_export, tree as history_tree
from ..engine import user_dir
from .files import Pending, check_readable, chats_sql, copy_to_memory, memory, read_only_connection, transient
from .files import reason as _reason
from .export import metrics_line  # noqa: F401 - the app imports it from here
from .schema import MIGRATIONS, migrate


def data_dir() -> Path:
    return user_dir("SSD_CHAT_DATA_DIR", "XDG_DATA_HOME", ".local/share")


def default_db_path() -> Path:
    return data_dir() / "history.db"


@dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    created_at: float
    updated_at: float
    num_messages: int = 0


@dataclass(frozen=True, slots=True)
class Message:
    id: int
    role: str
    content: str
    status: str
    created_at: float
    metrics: dict[str, Any] | None = None
    parent_id: int | None = None  # the message it follows (:mod:`ssd_chat.history.tree`)


LEAF: Any = object()  # add_message's default parent: the end of the current branch


class HistoryError(Exception):
    """A saved chat could not be read; ``str()`` is one line naming the file and the reason."""


def _title(text: str) -> str:
    line = " ".join(text.split())
    return line[:60] + ("…" if len(line) > 60 else "") or "(empty)"


class History:
    """The store.  ``History(None)`` is in-memory only (``--no-history`` style)."""

    def __init__(self, path: Path | str | None = None, *, timeout_s: float = 2.0, read_only: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self.warning: str | None = None
        self.resumed: str | None = None  # set when held-back writes reach the file; the app shows it once
        self.closed = False
        self.read_only = read_only
        self._pending: Pending | None = None  # writes the file has yet to take
        self._copied = False
        # Ids the caller may still hold.  An in-memory fallback that could not copy the file starts
        # its ids above these, so a stale id never names a different chat there.
        self._max_id = {"conversations": 0, "messages": 0}
        self.timeout_s = timeout_s
        self.db = self._open(timeout_s)

    # -- opening -------------------------------------------------------------------------
    def _open(self, timeout_s: float) -> sqlite3.Connection:
        if self.path is None:
            return memory()
        if self.read_only:
            return self._open_read_only()
        try:
            return self._connect(timeout_s)
        except (sqlite3.Error, OSError) as e:
            self._degrade(f"could not open the chat history {self.path}: {_reason(e)}")
            mem = self._copy_to_memory(None)
            self._hold_writes(e)
            return mem

    def _connect(self, timeout_s: float) -> sqlite3.Connection:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=timeout_s, check_same_thread=False)
        try:
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("PRAGMA journal_mode = WAL")
            if db.execute("PRAGMA user_version").fetchone()[0]:  # before any write, a migration's too: a file
                check_readable(db)  # the chats commands call corrupt is never written to
            migrate(db)
            return db
        except BaseException:
            db.close()
            raise

    def _open_read_only(self) -> sqlite3.Connection:
        """Reading never changes the file: no folder made, no migration (an older schema is brought up
        to date in a copy in memory)."""
        try:
            db = read_only_connection(self.path, self.timeout_s)  # type: ignore[arg-type]
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version == len(MIGRATIONS):
                check_readable(db)
                return db
            if version > len(MIGRATIONS):
                db.close()
                raise sqlite3.DatabaseError(f"schema version {version} is newer than this ssd-chat understands ({len(MIGRATIONS)})")
            mem = self._copy_to_memory(db)
            if not self._copied:
                raise sqlite3.DatabaseError("the file cannot be read")
            return mem
        except (sqlite3.Error, OSError) as e:
            self.warning = f"could not open the chat history {self.path}: {_reason(e)}"
            return memory()

    def _degrade(self, message: str) -> None:
        self.warning = f"{message}; this chat is kept in memory only and will not be saved"

    def _hold_writes(self, e: BaseException) -> None:
        """After a failure that may pass, keep the writes to save later (only on a full copy of the
        file: the ids they use must be the file's)."""
        if self._copied and transient(e) and not self.read_only:
            self._pending = Pending()
            self.warning = self.warning.split(";")[0] + "; this chat is kept in memory and saved when the file takes writes again"  # type: ignore[union-attr]

    @property
    def is_persistent(self) -> bool:
        return self.warning is None and self.path is not None

    def _write(self, fn: Callable[..., Any], keeps_id: bool = False) -> Any:
        """Run a write.  If the file database fails, carry on in memory (with a warning) and retry
        there; a write that fails in memory (a chat the copy does not have) is dropped: never raises.
        While writes are held back, each is kept to replay on the file (``keeps_id``: with the id it
        got here, passed as ``fn``'s second argument)."""
        if self.closed or self.read_only:
            return None
        self.retry()
        if self._pending is None:
            try:
                with self.db:
                    return fn(self.db)
            except sqlite3.Error as e:
                if not self.is_persistent:
                    return None
                self._degrade(f"could not write the chat history {self.path}: {_reason(e)}")
                self.db = self._copy_to_memory(self.db)
                self._hold_writes(e)
        try:
            with self.db:
                result = fn(self.db)
        except sqlite3.Error:
            return None
        if self._pending is not None:
            self._pending.add((lambda db: fn(db, result)) if keeps_id else fn)
        return result

    def retry(self, force: bool = False) -> None:
        """Save the held-back writes if the file takes them now (when due, or ``force``: wait the busy
        timeout).  Done by every write; the app also calls it when idle, and ``close`` forces it."""
        p = self._pending
        if p is None or self.closed or not (force or p.is_due()):
            return
        db = None
        try:
            db = self._connect(self.timeout_s if force else 0.0)
            p.replay(db)
        except (sqlite3.Error, OSError) as e:
            if db is not None:
                db.close()
            if transient(e):
                p.backoff()
                return
            self._pending = None  # the chat stays in memory
            why = "another program saved chats with the ids this chat uses" if isinstance(e, sqlite3.IntegrityError) else _reason(e)
            self._degrade(f"could not save the chat history {self.path}: {why}")
            return
        db.execute(f"PRAGMA busy_timeout = {int(self.timeout_s * 1000)}")
        self.db.close()
        self.db, self._pending, self.warning = db, None, None
        self.resumed = f"saving the chat history {self.path} again (nothing written meanwhile was lost)"

    def _copy_to_memory(self, source: sqlite3.Connection | None) -> sqlite3.Connection:
        """The file's contents in memory (see :func:`copy_to_memory`); ``_copied`` says whether it got them."""
        mem, self._copied = copy_to_memory(source, self.path, self.timeout_s)  # type: ignore[arg-type]
        return mem

    def _read(self, what: str, fn: Callable[[sqlite3.Connection], Any]) -> Any:
        try:
            return fn(self.db)
        except sqlite3.Error as e:
            where = self.path if self.is_persistent or self.read_only else "(in memory)"
            raise HistoryError(f"could not read {what} from the chat history {where}: {_reason(e)}") from None

    def _seen(self, table: str, ident: int | None) -> int | None:
        if ident is not None:
            self._max_id[table] = max(self._max_id[table], ident)
        return ident

    # -- conversations -------------------------------------------------------------------
    def new_conversation(self, title: str = "", system: str | None = None) -> int | None:
        """A new chat; ``system``: the system prompt it starts with (its first message)."""
        now = time.time()

        def go(db: sqlite3.Connection, ident: int | None = None) -> int:
            cur = db.execute(
                "INSERT INTO conversations(id, title, system, created_at, updated_at) "
                "VALUES (coalesce(?, (SELECT max(coalesce(max(id), 0), ?) + 1 FROM conversations)),?,NULL,?,?)",
                (ident, self._max_id["conversations"], _title(title) if title else "(new chat)", now, now),
            )
            return int(cur.lastrowid)

        cid = self._seen("conversations", self._write(go, keeps_id=True))
        if system:
            self.add_message(cid, "system", system)
        return cid

    def set_system(self, conversation_id: int | None, system: str | None) -> int | None:
        """The system prompt from here on: a ``system`` message after the chat's last one ('' clears it)."""
        return self.add_message(conversation_id, "system", system or "")

    def list_conversations(self) -> list[Conversation]:
        """Every chat, newest first.  A title that is not valid UTF-8 is listed with its bad bytes as
        ``\\xff`` escapes (a label): one damaged chat does not hide the others."""
        rows = self._read("the list of chats", lambda db: db.execute(chats_sql(raw=True)).fetchall())
        for r in rows:
            self._seen("conversations", r[0])
        return [Conversation(r[0], _label(r[1]), *r[2:]) for r in rows]

    def get_conversation(self, conversation_id: int) -> Conversation | None:
        """One chat, its texts exactly as stored (one that is not valid UTF-8 raises HistoryError)."""
        rows = self._read(f"chat {conversation_id}", lambda db: db.execute(
            chats_sql(raw=False, where="WHERE c.id = ?"), (conversation_id,)).fetchall())
        return Conversation(*rows[0]) if rows else None

    def delete_conversation(self, conversation_id: int) -> bool:
        cur = self._write(lambda db: db.execute("DELETE FROM conversations WHERE id=?", (conversation_id,)))
        return bool(cur and cur.rowcount)

    # -- messages ------------------------------------------------------------------------
    def add_message(self, conversation_id: int | None, role: str, content: str, status: str = "done",
                    parent: int | None = LEAF) -> int | None:
        """A message after ``parent`` (default: at the end of the current branch; None: a first message).
        When ``parent`` has other children, this one starts a new branch there, which becomes the current one."""
        if conversation_id is None:
            return None
        now = time.time()

        def go(db: sqlite3.Connection, ident: int | None = None) -> int:
            after = parent
            if after is LEAF:
                after = (history_tree.current_path(history_tree.rows_of(db, conversation_id)) or [None])[-1]
            cur = db.execute(
                "INSERT INTO messages(id, conversation_id, role, content, status, created_at, parent_id) "
                "VALUES (coalesce(?, (SELECT max(coalesce(max(id), 0), ?) + 1 FROM messages)),?,?,?,?,?,?)",
                (ident, self._max_id["messages"], conversation_id, role, content, status, now, after),
            )
            db.execute("UPDATE messages SET active = (id = ?) WHERE conversation_id=? AND parent_id IS ?",
                       (cur.lastrowid, conversation_id, after))
            db.execute("UPDATE conversations SET updated_at=? WHERE id=?", (now, conversation_id))
            if role == "user":  # the first prompt names the chat
                db.execute(
                    "UPDATE conversations SET title=? WHERE id=? AND title='(new chat)'", (_title(content), conversation_id)
                )
            return int(cur.lastrowid)

        return self._seen("messages", self._write(go, keeps_id=True))

    def update_message(self, message_id: int | None, content: str, status: str) -> None:
        """Save a reply's text so far (called while streaming, and when it ends)."""
        if message_id is None:
            return
        self._write(lambda db: db.execute("UPDATE messages SET content=?, status=? WHERE id=?", (content, status, message_id)))

    def save_metrics(self, message_id: int | None, stats: Any, target: str | None = None, draft: str | None = None) -> None:
        """Store a reply's :class:`~ssd_chat.engine.events.Stats` (any dataclass or dict)."""
        if message_id is None:
            return
        import dataclasses

        d = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)

        def go(db: sqlite3.Connection) -> None:
            db.execute(
                """INSERT OR REPLACE INTO turn_metrics(message_id, mode, target, draft, new_tokens, tok_per_s, ttft_s,
                   mean_accepted_length, acceptance_rate, cache_hit_rate, stats_json) VALUES (?,?,?,?,?,?,?,?,?,?,?)""",
                (message_id, history_export.mode_column(d), target, draft, d.get("new_tokens"), d.get("tok_per_s"), d.get("ttft_s"),
                 d.get("mean_accepted_length"), d.get("acceptance_rate"), d.get("cache_hit_rate"), json.dumps(d)),
            )

        self._write(go)

    def messages(self, conversation_id: int, all_branches: bool = False) -> list[Message]:
        """The chat's current branch, first to last; ``all_branches``: every message, oldest first."""
        rows = self._read(f"chat {conversation_id}", lambda db: db.execute(
            """SELECT m.id, m.role, m.content, m.status, m.created_at, t.stats_json, t.target, t.draft, m.parent_id, m.active
               FROM messages m LEFT JOIN turn_metrics t ON t.message_id = m.id
               WHERE m.conversation_id=? ORDER BY m.id""",
            (conversation_id,),
        ).fetchall())
        out = []
        path = history_tree.current_path([(r[0], r[8], r[9], r[1]) for r in rows])
        if not all_branches:
            where = {r[0]: r for r in rows}
            rows = [where[i] for i in path]
        for mid, role, content, status, created, stats_json, target, draft, parent, _ in rows:
            metrics = None
            if stats_json:
                try:
                    metrics = dict(json.loads(stats_json))
                    metrics["target"], metrics["draft"] = target, draft
                except (ValueError, TypeError):  # damaged metrics: the message itself is still shown
                    metrics = None
            out.append(Message(self._seen("messages", mid), role, content, status, created, metrics, parent))
        return out

    # -- branches (:mod:`ssd_chat.history.tree`) -----------------------------------------
    def branches(self, conversation_id: int) -> dict[int, tuple[int, int]]:
        """Message id -> (its place among its siblings from 1, how many), for the messages that have siblings."""
        return history_tree.positions(self._read(f"chat {conversation_id}", lambda db: history_tree.rows_of(db, conversation_id)))

    def parent_of(self, message_id: int) -> int | None:
        row = self._read("a message", lambda db: db.execute("SELECT parent_id FROM messages WHERE id=?", (message_id,)).fetchone())
        return row[0] if row else None

    def switch(self, conversation_id: int, message_id: int, by: int) -> int | None:
        """Make the sibling ``by`` places from ``message_id`` (-1: the one before) the current branch; its id,
        or None when there is none that way (nothing changes)."""
        def go(db: sqlite3.Connection) -> int | None:
            rows = history_tree.rows_of(db, conversation_id)
            to = history_tree.step(rows, message_id, by)
            if to is not None:
                history_tree.make_active(db, conversation_id, rows, to)
            return to

        return self._write(go)

    def set_title(self, conversation_id: int | None, text: str) -> None:
        self._write(lambda db: db.execute("UPDATE conversations SET title=? WHERE id=?", (_title(text), conversation_id)))

    # -- export (:mod:`ssd_chat.history.export`) -----------------------------------------
    def export(self, conversation_id: int, fmt: str = "md", all_branches: bool = False) -> str:
        """The chat's current branch as ``md``, ``jsonl`` or ``json`` (``all_branches``: every message, each
        with its id and parent); KeyError when there is no such chat."""
        writer = {"md": history_export.markdown, "jsonl": history_export.jsonl, "json": history_export.json_document}[fmt]
        conv = self.get_conversation(conversation_id)
        if conv is None:
            raise KeyError(f"no conversation with id {conversation_id}")
        if not all_branches:
            return writer(conv, self.messages(conversation_id))
        current = {m.id for m in self.messages(conversation_id)}
        return writer(conv, self.messages(conversation_id, all_branches=True), tree=current)

    def close(self) -> None:
        """Close; writes still held back get one last chance (waiting the busy timeout)."""
        self.retry(force=True)
        if self._pending is not None:  # still refused: say plainly that this chat was not saved
            self._pending = None
            self._degrade((self.warning or "").split(";")[0])
        self.closed = True
        with contextlib.suppress(sqlite3.Error):
            self.db.close()


def _label(raw: bytes | str | None) -> str | None:
    return raw.decode("utf-8", "backslashreplace") if isinstance(raw, bytes) else raw
