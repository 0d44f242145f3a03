"""Helpers for the history and recorder tests: chat databases and recordings."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ssd_chat.history.store import History
from ssd_chat.chat.recorder import Recorder


def chat_db(path: Path, n: int = 3, long_reply_in: int | None = None) -> Path:
    """Chats 1..n; chat ``long_reply_in``'s reply is long enough to live in overflow pages of its own."""
    h = History(path)
    for i in range(1, n + 1):
        cid = h.new_conversation(f"chat {i}")
        h.add_message(cid, "user", f"question {i}")
        h.add_message(cid, "assistant", ("Z" if i == long_reply_in else "A") * (20_000 if i == long_reply_in else 20))
    h.close()  # the last connection checkpoints the WAL into the file
    return path


WORDS = ["Speculative", " decoding", " drafts", " tokens", " and", " verifies", " them", "."]


def make_recording(path: Path, turns: list[tuple[str, list]]) -> None:
    with Recorder(path, {"mode": "ssd", "target": "t", "draft": "d", "k": 3}) as rec:
        for prompt, events in turns:
            rec.turn(prompt, None, {"mode": "ssd", "k": 3})
            for ev in events:
                rec.event(ev)
        rec.vocab({900: "x", 950: "zz"})


def shipped() -> list[Path]:
    import ssd_chat.assets

    return sorted((Path(ssd_chat.assets.__file__).parent / "recordings").glob("*.jsonl"))


# The real app on a recorded session that keeps its chat in the history file ``argv[1]`` (``demo --replay``
# keeps none): what the history fault tests drive in a real terminal, with no model to load.
REPLAY_SAVING_CHATS = """import sys
from ssd_chat.chat.backend import ReplayBackend
from ssd_chat.chat.recorder import read
from ssd_chat.cli.chat import launch
sys.exit(launch({"db": sys.argv[1]}, backend=ReplayBackend(read(sys.argv[2]), float(sys.argv[3])), type_delay_s=0.0))
"""


def replay_saving_chats(db: Path, source: Path, speed: float) -> list[str]:
    return ["-c", REPLAY_SAVING_CHATS, str(db), str(source), str(speed)]


def lock(path: Path, readers_too: bool = False) -> sqlite3.Connection:
    """Another program's write lock (``readers_too``: exclusive locking mode, which even keeps readers out)."""
    other = sqlite3.connect(path)
    if readers_too:
        other.execute("PRAGMA locking_mode = EXCLUSIVE")
    other.execute("BEGIN EXCLUSIVE")
    return other


def release(other: sqlite3.Connection) -> None:
    other.rollback()
    other.close()
