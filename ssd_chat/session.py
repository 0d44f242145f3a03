"""A conversation: messages -> chat template -> token ids -> engine -> events.

The session keeps the history; a reply that was stopped (Esc, Ctrl-C) or failed
half-way still enters the history with the text that streamed, so nothing is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from .engine import chat
from .engine.events import Done, Error, Event, Token
from .engine.params import SamplingParams


class Session:
    def __init__(self, engine: Any, system: str | None = None, params: SamplingParams | None = None,
                 messages: list[dict[str, str]] | None = None) -> None:
        self.engine = engine
        self.system = system
        self.params = params or SamplingParams()
        self.messages: list[dict[str, str]] = list(messages or [])

    def stream(self, user_text: str, params: SamplingParams | None = None,
               stop: threading.Event | None = None) -> Iterator[Event]:
        """Stream the reply to ``user_text``; the history is updated when it ends."""
        if not user_text.strip():
            raise ValueError("the prompt is empty")
        params = params or self.params
        msgs = chat.messages_for(user_text, self.system, self.messages)
        ids, extra_stop = self.engine.prompt_ids(msgs)
        if extra_stop:
            params = replace(params, stop=tuple(params.stop) + tuple(extra_stop))
        reply = ""  # what streamed so far; Done/Error carry the authoritative text
        try:
            for ev in self.engine.stream(ids, params, stop):
                if isinstance(ev, Token):
                    reply += ev.text
                elif isinstance(ev, (Done, Error)):
                    reply = ev.text or reply
                yield ev
        finally:
            self.messages.append({"role": "user", "content": user_text})
            self.messages.append({"role": "assistant", "content": reply})

    def new_chat(self) -> None:
        self.messages.clear()
