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
import threading
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ValidationError

from ..engine import events as _events, Done, Error, Event

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


def at_speed(d: dict[str, Any], scale: float) -> dict[str, Any]:
    """An event's times (``*_s``, nested stats too) divided by ``scale``, its rates multiplied."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = at_speed(v, scale)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            v = v * scale if k.endswith("_per_s") else v / scale if k.endswith("_s") else v
        out[k] = v
    return out


def at_speed_event(ev: Event, scale: float) -> Event:
    return _events.from_dict(at_speed(_events.to_dict(ev), scale))


class Recorder:
    """Appends a session's turns and events to a JSONL file (thread-safe, flushed per line).

    A file that cannot be written at the start raises :class:`RecordingError`.  One that fails
    later (a full disk) stops the recording: ``error`` says why, and no call raises, so the chat
    being recorded goes on.
    """

    def __init__(self, path: Path | str, info: dict[str, Any] | None = None, time_scale: float = 1.0) -> None:
        self.path = Path(path)
        self.time_scale = time_scale  # a slow-motion simulation's clock runs this much slow: events are written at speed
        self.error: str | None = None
        self._lock = threading.Lock()
        self._turn = -1
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f: IO[str] | None = self.path.open("w", encoding="utf-8")
        except OSError as e:
            raise RecordingError(f"cannot write the recording {self.path}: {e.strerror or e}") from None
        _events.codec()  # build the event codec now, not on the first token
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
        d = _events.to_dict(ev) if self.time_scale == 1.0 else at_speed(_events.to_dict(ev), self.time_scale)
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


class _Header(BaseModel):
    format: Any = None
    version: int = 0
    info: dict[str, Any] = {}


class _Turn(BaseModel):
    prompt: str = ""
    system: str | None = None
    settings: dict[str, Any] = {}


class _Vocab(BaseModel):
    tokens: dict[int, str] = {}


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
        kind = None
        try:
            obj = json.loads(line, parse_constant=_not_finite)
            kind = obj.get("type") if isinstance(obj, dict) else None
            if kind == "Header":
                head = _Header.model_validate(obj)
                if head.format != FORMAT:
                    raise ValueError(f"not an ssd-chat event log (format {head.format!r})")
                if head.version > VERSION:
                    raise ValueError(f"recorded by a newer ssd-chat (version {head.version})")
                info = head.info
            elif kind == "Vocab":
                if info is None:
                    raise ValueError("vocabulary before the header line")
                info.setdefault("vocab", {}).update(_Vocab.model_validate(obj).tokens)
            elif kind == "Turn":
                turn = _Turn.model_validate(obj)
                turns.append(RecordedTurn(turn.prompt, turn.system, turn.settings))
                turn_lines.append(n)
            elif kind in EVENT_TYPES:
                if info is None:
                    raise ValueError("events before the header line")
                if not turns:  # an event log written without turns (e.g. from `ask`)
                    turns.append(RecordedTurn(""))
                    turn_lines.append(n)
                turns[-1].events.append(_event(line))
            else:
                raise ValueError(f"unknown line type {kind!r}")
        except ValidationError as e:
            raise RecordingError(f"{path}, line {n}: {_explain(kind, e)}") from None
        except ValueError as e:
            raise RecordingError(f"{path}, line {n}: {e}") from None
    if info is None:
        raise RecordingError(f"{path} is empty or not an ssd-chat event log")
    for turn, n in zip(turns, turn_lines):  # the app waits for each reply's end: it must be there
        if not any(isinstance(ev, (Done, Error)) for ev in turn.events):
            raise RecordingError(f"{path}, line {n}: this turn has no Done or Error event (the recording was cut short)")
    return Recording(info, turns)


def _not_finite(name: str) -> None:
    raise ValueError(f"{name} is not a finite number")


def _event(line: str) -> Event:
    """The event on ``line``, every field of its declared type, at a time a replay can wait for."""
    ev = _events.from_json(line)
    t = event_time(ev)
    if t is not None and not 0 <= t <= MAX_EVENT_S:
        raise ValueError(f"t_s must be between 0 and {MAX_EVENT_S:.0f} seconds, got {t!r}")
    return ev


# what a field must be, by pydantic's error type
_WANTS = {"int_type": "an integer", "int_parsing": "an integer", "int_from_float": "an integer", "float_type": "a number",
          "float_parsing": "a number", "string_type": "a string", "bool_type": "true or false", "bool_parsing": "true or false",
          "tuple_type": "a list", "list_type": "a list", "dict_type": "an object", "dataclass_type": "an object"}


def _explain(kind: str | None, e: ValidationError) -> str:
    """pydantic's first complaint as one line, e.g. ``Round field 'predicted'[0][1] must be a list, got 'x'``."""
    err = e.errors(include_url=False)[0]
    path = list(err["loc"])
    if path[:1] == [kind]:  # the event union's tag
        path = path[1:]
    cls = getattr(_events, str(kind), None)  # name the dataclass a nested field belongs to (Done's stats)
    while cls is not None and len(path) > 1 and dataclasses.is_dataclass(sub := typing.get_type_hints(cls).get(path[0])):
        cls, path = sub, path[1:]
    name = cls.__name__ if cls is not None else kind
    if not path:
        return f"{name}: {err['msg']}"
    field, where = path[0], "".join(f"[{p}]" for p in path[1:])
    if err["type"] == "missing":
        return f"{name} has no '{field}'"
    want = err.get("ctx", {}).get("expected") if err["type"] == "literal_error" else _WANTS.get(err["type"])
    return f"{name} field '{field}'{where} " + (f"must be {want}" if want else err["msg"].lower()) + f", got {err['input']!r:.60}"


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
    from ..engine import Token

    for ev in events:
        t = event_time(ev)
        if t is not None:
            wait = t / speed - (clock() - t0)
            if wait > 0:
                stop.wait(wait)  # returns early when stopped
        if stop.is_set() and not isinstance(ev, (Done, Error)):
            from ..engine import Stats

            last_stats = next((e.stats for e in reversed(events) if isinstance(e, Done)), None)
            stats = last_stats or Stats("replay", len(ids), 0, clock() - t0, 0.0, None, None, None, None, None)
            yield Done("cancelled", text, tuple(ids), stats)
            return
        if isinstance(ev, Token):
            text += ev.text
            ids.append(ev.id)
        yield ev
