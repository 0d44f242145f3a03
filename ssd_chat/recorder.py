"""Event logs: write a session's event stream as JSONL, read it back, replay it at recorded timing.

The file is one JSON object per line::

    {"type": "Header", "format": "ssd-chat-events", "version": 1, "created": "...", "info": {...}}
    {"type": "Turn", "turn": 0, "prompt": "...", "system": null, "settings": {...}}
    {"type": "Token", "turn": 0, "id": 42, "text": "Hi", "source": "target", "t_s": 0.31}
    {"type": "Round", "turn": 0, ...}
    {"type": "Done", "turn": 0, "reason": "eos", "text": "...", "token_ids": [...], "stats": {...}}

Events are :func:`ssd_chat.engine.events.to_dict` with a ``turn`` field; their ``t_s`` is
seconds since that turn's request started, which is all a replay needs for its timing.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .engine import events as _events
from .engine.events import Done, Error, Event, from_dict, to_dict

FORMAT = "ssd-chat-events"
VERSION = 1
EVENT_TYPES = ("Token", "Round", "Notice", "Done", "Error")
# A replay waits until each event's t_s: a larger time is a damaged file, not a reply worth sitting through.
MAX_EVENT_S = 3600.0


class RecordingError(ValueError):
    """A recording cannot be read; ``str()`` names the file and line."""


@dataclass
class RecordedTurn:
    prompt: str
    system: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)


@dataclass
class Recording:
    info: dict[str, Any]
    turns: list[RecordedTurn]


class Recorder:
    """Appends a session's turns and events to a JSONL file (thread-safe, flushed per line).

    A file that cannot be written at the start raises :class:`RecordingError`.  One that fails
    later (a full disk) stops the recording: ``error`` says why, and no call raises, so the chat
    being recorded goes on.
    """

    def __init__(self, path: Path | str, info: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.error: str | None = None
        self._lock = threading.Lock()
        self._turn = -1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f: IO[str] | None = self.path.open("w", encoding="utf-8")
        except OSError as e:
            raise RecordingError(f"cannot write the recording {self.path}: {e.strerror or e}") from None
        self._write({"type": "Header", "format": FORMAT, "version": VERSION,
                     "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "info": dict(info or {})})
        if self.error:  # e.g. /dev/full: nothing at all can be recorded
            raise RecordingError(f"cannot write the recording {self.path}: {self.error}")

    def _write(self, obj: dict[str, Any]) -> None:
        with self._lock:
            if self._f is None:
                return
            try:
                self._f.write(json.dumps(obj, ensure_ascii=False) + "\n")
                self._f.flush()
            except (OSError, ValueError) as e:
                self.error = getattr(e, "strerror", None) or str(e)
                self._close_locked()

    def turn(self, prompt: str, system: str | None = None, settings: dict[str, Any] | None = None) -> int:
        """Start a new turn (a user prompt); the events that follow belong to it."""
        self._turn += 1
        self._write({"type": "Turn", "turn": self._turn, "prompt": prompt, "system": system, "settings": dict(settings or {})})
        return self._turn

    def vocab(self, tokens: dict[int, str]) -> None:
        """Token texts for ids that appear only as predictions (so a replay can show them)."""
        self._write({"type": "Vocab", "tokens": {str(k): v for k, v in tokens.items()}})

    def event(self, ev: Event) -> None:
        d = to_dict(ev)
        d["turn"] = max(self._turn, 0)
        self._write(d)

    @property
    def stopped_reason(self) -> str | None:
        """One line for the user when the recording stopped early, else None."""
        return None if self.error is None else f"recording stopped: cannot write {self.path} ({self.error})"

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()  # flushes: can fail on a full disk too
            except (OSError, ValueError) as e:
                self.error = self.error or getattr(e, "strerror", None) or str(e)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read(path: Path | str) -> Recording:
    """Parse a recording; a bad file raises :class:`RecordingError` naming the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise RecordingError(f"no recording at {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecordingError(f"cannot read the recording {path}: {e}") from None
    info: dict[str, Any] | None = None
    turns: list[RecordedTurn] = []
    turn_lines: list[int] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            kind = obj.get("type")
            if kind == "Header":
                if obj.get("format") != FORMAT:
                    raise ValueError(f"not an ssd-chat event log (format {obj.get('format')!r})")
                if int(obj.get("version", 0)) > VERSION:
                    raise ValueError(f"recorded by a newer ssd-chat (version {obj.get('version')})")
                info = dict(obj.get("info") or {})
            elif kind == "Vocab":
                if info is None:
                    raise ValueError("vocabulary before the header line")
                info.setdefault("vocab", {}).update({int(k): str(v) for k, v in dict(obj.get("tokens") or {}).items()})
            elif kind == "Turn":
                turns.append(RecordedTurn(str(obj.get("prompt", "")), obj.get("system"), dict(obj.get("settings") or {})))
                turn_lines.append(n)
            elif kind in EVENT_TYPES:
                if info is None:
                    raise ValueError("events before the header line")
                if not turns:  # an event log written without turns (e.g. from `ask`)
                    turns.append(RecordedTurn(""))
                    turn_lines.append(n)
                obj.pop("turn", None)
                check_event(obj)
                turns[-1].events.append(from_dict(obj))
            else:
                raise ValueError(f"unknown line type {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise RecordingError(f"{path}, line {n}: {e}") from None
    if info is None:
        raise RecordingError(f"{path} is empty or not an ssd-chat event log")
    for turn, n in zip(turns, turn_lines):  # the app waits for each reply's end: it must be there
        if not any(isinstance(ev, (Done, Error)) for ev in turn.events):
            raise RecordingError(f"{path}, line {n}: this turn has no Done or Error event (the recording was cut short)")
    return Recording(info, turns)


def check_event(obj: dict[str, Any]) -> None:
    """ValueError unless ``obj`` has every field its event needs, each of its declared type, and
    times a replay can wait for (from_dict itself takes whatever the JSON holds)."""
    cls = getattr(_events, obj["type"])
    _check_fields(cls, obj)
    t = obj.get("t_s")
    if t is not None and not 0 <= t <= MAX_EVENT_S:
        raise ValueError(f"t_s must be between 0 and {MAX_EVENT_S:.0f} seconds, got {t!r}")


def _check_fields(cls: type, obj: dict[str, Any]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in obj:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{cls.__name__} has no '{f.name}'")
        elif dataclasses.is_dataclass(hints[f.name]) and isinstance(obj[f.name], dict):
            _check_fields(hints[f.name], obj[f.name])  # Done's stats: name the field inside
        elif not _fits(obj[f.name], hints[f.name]):
            raise ValueError(f"{cls.__name__} field '{f.name}' must be {_describe(hints[f.name])}, got {obj[f.name]!r:.60}")


def _fits(v: Any, hint: Any) -> bool:
    """Whether a JSON value can stand for a field declared as ``hint`` (lists stand for tuples)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(v, a) for a in args)
    if origin is typing.Literal:
        return v in args
    if origin is tuple:
        if not isinstance(v, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_fits(x, args[0]) for x in v)
        return len(v) == len(args) and all(_fits(x, a) for x, a in zip(v, args))
    if hint is type(None):
        return v is None
    if hint is bool:
        return isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if hint is str:
        return isinstance(v, str)
    if dataclasses.is_dataclass(hint):
        return isinstance(v, dict)
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if typing.get_origin(hint) is tuple:
        return "a list"
    return {type(None): "null", int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def event_time(ev: Event) -> float | None:
    """When an event happened within its turn (Done/Error have no time: they follow the last one)."""
    return getattr(ev, "t_s", None)


def replay(events: list[Event], speed: float = 1.0, stop: threading.Event | None = None,
           clock: Any = time.perf_counter) -> Iterator[Event]:
    """Yield ``events`` at their recorded times divided by ``speed``; ``stop`` ends it early.

    A stopped replay ends with ``Done(reason="cancelled")`` carrying the text yielded so far,
    just as a live engine does.
    """
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    stop = stop or threading.Event()
    t0 = clock()
    text, ids = "", []
    from .engine.events import Token

    for ev in events:
        t = event_time(ev)
        if t is not None:
            wait = t / speed - (clock() - t0)
            if wait > 0:
                stop.wait(wait)  # returns early when stopped
        if stop.is_set() and not isinstance(ev, (Done, Error)):
            from .engine.events import Stats

            last_stats = next((e.stats for e in reversed(events) if isinstance(e, Done)), None)
            stats = last_stats or Stats("replay", len(ids), 0, clock() - t0, 0.0, None, None, None, None, None)
            yield Done("cancelled", text, tuple(ids), stats)
            return
        if isinstance(ev, Token):
            text += ev.text
            ids.append(ev.id)
        yield ev
