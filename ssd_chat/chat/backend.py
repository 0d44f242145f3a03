"""What the chat app and the demo drive: a live engine, a recorded session, or (in tests) a scripted fake.

Every backend turns a conversation into the engine's one event stream; the app never
looks further in.  All methods but :meth:`Backend.stream`'s iteration are called from the
UI thread or from the app's load worker; iteration happens in the reply worker thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..engine import Event, SamplingParams

Progress = Callable[[str, "float | None"], None]
SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "frequency_penalty", "presence_penalty")


def sampling_of(settings: Any) -> dict[str, Any]:
    """The sampling settings among ``settings`` (SamplingParams or a dict), for the panel and recordings."""
    get = settings.get if isinstance(settings, dict) else (lambda k: getattr(settings, k, None))
    return {k: get(k) for k in SAMPLING if get(k) is not None}


class Backend:
    """The interface (and a do-nothing base)."""

    #: True when the backend replays prompts of its own (the app types them in)
    scripted_prompts: tuple[str, ...] = ()

    def warn(self, message: str) -> None:
        """Where :meth:`load` reports a warning found before loading; the app replaces it with its notice."""

    def load(self, progress: Progress) -> None:
        """Get ready (load models).  Raise an exception with a readable ``str()`` on failure."""

    def info(self) -> dict[str, Any]:
        """mode, k, fan_out, target, draft, target_device, draft_device: what is actually in use."""
        return {}

    def stream(self, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event) -> Iterator[Event]:
        raise NotImplementedError

    def sampling_defaults(self) -> dict[str, Any]:
        """Sampling settings for the ones the user left unset (the loaded model's; none: SamplingParams')."""
        return {}

    def reconfigure(self, **changes: Any) -> None:
        """Switch mode / k / fan_out between replies without reloading models."""
        raise ValueError("this session cannot change its settings")

    def token_text(self, token_id: int) -> str | None:
        """The text of one token id (for the speculation-cache view), if known."""
        return None

    def count_tokens(self, text: str) -> tuple[int, int | None] | None:
        """``text``'s tokens by the target's tokenizer, and the target's context (None: it cannot count now)."""
        return None

    def close(self) -> None:
        """Release models and worker processes (called once, on quit)."""


def readable(e: BaseException) -> str:
    from ..engine import SSDChatError

    if isinstance(e, (SSDChatError, ValueError, FileNotFoundError)):
        return str(e) or type(e).__name__
    return f"{type(e).__name__}: {e}"


class EngineBackend(Backend):
    """The real engine, configured from resolved settings (``ssd_chat.chat.settings.resolve``)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.engine: Any = None

    def load(self, progress: Progress) -> None:
        from .settings import engine_config
        from ..engine import Engine
        from .loading import quiet_libraries, tqdm_to

        quiet_libraries()
        self.engine = Engine.load(engine_config(self.values), progress=progress, tqdm_class=tqdm_to(progress), warn=self.warn,
                                  measure="background")
        self._start_decoder()

    def _start_decoder(self) -> None:
        """SSD: the speculator starts loading its draft now, while the user reads the panel, not at the first reply."""
        with contextlib.suppress(Exception):  # the first reply reports a decoder that cannot start, as an Error event
            self.engine.decoder()

    def info(self) -> dict[str, Any]:
        if self.engine is None:
            return {"mode": self.values.get("mode"), "target": self.values.get("target")}
        return self.engine.describe()

    def sampling_defaults(self) -> dict[str, Any]:
        return self.engine.sampling_defaults if self.engine is not None else {}

    def stream(self, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event) -> Iterator[Event]:
        from .session import stream_messages  # a chat longer than the context leaves out its oldest turns

        return stream_messages(self.engine, messages, params, stop)

    def reconfigure(self, **changes: Any) -> None:
        self.engine.reconfigure(**changes)
        self._start_decoder()

    def token_text(self, token_id: int) -> str | None:
        try:
            return self.engine.tokenizer.decode([token_id])
        except Exception:  # noqa: BLE001
            return None

    def count_tokens(self, text: str) -> tuple[int, int | None] | None:
        if self.engine is None:
            return None
        from .attach import count
        from .session import context_window

        return count(self.engine.tokenizer, text), context_window(self.engine)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class ReplayBackend(Backend):
    """Plays a recorded session: each reply is the next recorded turn, at recorded timing / speed."""

    def __init__(self, recording: Any, speed: float = 1.0) -> None:
        if not speed > 0:
            raise ValueError(f"--speed must be > 0, got {speed}")
        self.recording = recording
        self.speed = speed
        self._next = 0
        self.scripted_prompts = tuple(t.prompt for t in recording.turns)
        self._vocab: dict[int, str] = {int(k): v for k, v in (recording.info.get("vocab") or {}).items()}

    def load(self, progress: Progress) -> None:
        progress("replaying a recorded session (no model loaded)", 1.0)

    def sampling_defaults(self) -> dict[str, Any]:
        return sampling_of(self.info())  # what the recorded turn sampled with

    def info(self) -> dict[str, Any]:
        i = dict(self.recording.info)
        i.pop("vocab", None)
        i["replay"] = True
        if self.recording.turns:  # the settings of the turn about to play (asked as a turn starts)
            i.update(self.recording.turns[min(self._next, len(self.recording.turns) - 1)].settings)
        return i

    def stream(self, messages: list[dict[str, str]], params: SamplingParams, stop: threading.Event) -> Iterator[Event]:
        from .recorder import replay

        if self._next >= len(self.recording.turns):
            from ..engine import Error

            return iter([Error("the recording has no more turns", "replay")])
        turn = self.recording.turns[self._next]
        self._next += 1
        return replay(turn.events, self.speed, stop)

    def token_text(self, token_id: int) -> str | None:
        return self._vocab.get(token_id)
