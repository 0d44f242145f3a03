"""A conversation: messages -> chat template -> token ids -> engine -> events.

The session keeps the history; a reply that was stopped (Esc, Ctrl-C) or failed
half-way still enters the history with the text that streamed, so nothing is lost.

A chat that outgrows the model's context window goes on as chat apps do: :func:`fit_context`
leaves the oldest turns out of the prompt (system prompts stay) and the reply starts with
a Notice saying how many.  The chat app, ``ask`` and the demo all keep their conversation in
a :class:`Session`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

from ..engine import messages_for, Done, Error, Event, Notice, Token, SamplingParams


def context_window(engine: Any) -> int | None:
    """The target's context length in tokens (None when the model does not say)."""
    return int(getattr(engine.target.model.config, "max_position_embeddings", 0) or 0) or None


def reply_room(engine: Any, params: SamplingParams, window: int) -> int:
    """Tokens kept free for the reply.  Dropping turns only once the prompt alone overflows would
    leave every later reply a handful of tokens; a quarter of the window (or max-new-tokens if
    smaller) is kept, plus the draft tokens SD/SSD score past the end."""
    lookahead = engine.config.k + 1 if engine.config.mode != "ar" else 0
    return min(params.max_new_tokens, window // 4) + lookahead


def fit_context(engine: Any, messages: list[dict[str, str]], params: SamplingParams) -> tuple[list[int], tuple[str, ...], int]:
    """Prompt ids for ``messages`` (system?, earlier turns, the new user message) and stop strings,
    leaving out the oldest turns while the prompt and the reply's room do not fit the context window.
    Returns (ids, stop strings, number of turns left out).  If the newest message alone does not fit,
    its ids are returned as they are and the engine says so."""
    ids, stop = engine.prompt_ids(messages)
    window = context_window(engine)
    if window is None:
        return ids, stop, 0
    body, last = messages[:-1], messages[-1:]
    dropped = 0
    while any(m["role"] != "system" for m in body) and len(ids) + reply_room(engine, params, window) > window:
        # a turn is a user message and what answered it, up to the next user message; system prompts stay where they are
        first = next(i for i, m in enumerate(body) if m["role"] != "system")
        nxt = next((i for i in range(first + 1, len(body)) if body[i]["role"] == "user"), len(body))
        body, dropped = body[:first] + [m for m in body[first:nxt] if m["role"] == "system"] + body[nxt:], dropped + 1
        ids, stop = engine.prompt_ids(body + last)
    return ids, stop, dropped


def dropped_notice(engine: Any, dropped: int) -> Notice:
    window = context_window(engine)
    turns = "turn" if dropped == 1 else "turns"
    return Notice(f"the chat is longer than {engine.target.name}'s context of {window} tokens: this reply does not see "
                  f"the oldest {dropped} {turns} (the system prompt is kept)", "warning")


def stream_messages(engine: Any, messages: list[dict[str, str]], params: SamplingParams,
                    stop: threading.Event | None = None) -> Iterator[Event]:
    """The engine's reply to ``messages``, fitted to the context window (a Notice first if turns were left out)."""
    ids, extra_stop, dropped = fit_context(engine, messages, params)
    if extra_stop:
        params = replace(params, stop=tuple(params.stop) + tuple(extra_stop))
    if dropped:
        yield dropped_notice(engine, dropped)
    yield from engine.stream(ids, params, stop)


ReplyStream = Callable[[list[dict[str, str]], SamplingParams, "threading.Event | None"], Iterator[Event]]


class Session:
    """The conversation so far, and the reply to the next message.

    ``engine`` answers through :func:`stream_messages` (fitted to its context window); the chat app passes
    ``reply`` instead, its backend's ``stream`` (the engine through the same function, a recording, or in
    tests a script)."""

    def __init__(self, engine: Any = None, system: str | None = None, params: SamplingParams | None = None,
                 messages: list[dict[str, str]] | None = None, *, reply: ReplyStream | None = None) -> None:
        if reply is None and engine is None:
            raise ValueError("a Session needs an engine or a reply function")
        self.engine = engine
        self.reply: ReplyStream = reply or partial(stream_messages, engine)
        self.system = system
        self.params = params or SamplingParams()
        self.messages: list[dict[str, str]] = list(messages or [])

    def stream(self, user_text: str, params: SamplingParams | None = None,
               stop: threading.Event | None = None) -> Iterator[Event]:
        """Stream the reply to ``user_text``; the history is updated when it ends (stopped or failed too)."""
        if not user_text.strip():
            raise ValueError("the prompt is empty")
        params = params or self.params
        msgs = self.prompt_messages(user_text)
        reply = ""  # what streamed so far; Done/Error carry the authoritative text
        try:
            for ev in self.reply(msgs, params, stop):
                if isinstance(ev, Token):
                    reply += ev.text
                elif isinstance(ev, (Done, Error)):
                    reply = ev.text or reply
                yield ev
        finally:
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]

    def prompt_messages(self, user_text: str) -> list[dict[str, str]]:
        """What the model is asked.  A system prompt set during the chat is a message where it was set
        (the replies before it did not see it); a later one replaces it, and an empty one clears it."""
        turns = [i for i, m in enumerate(self.messages) if m["role"] == "system"]
        if not turns:
            return messages_for(user_text, self.system, self.messages)
        keep = [m for i, m in enumerate(self.messages) if m["role"] != "system" or (i == turns[-1] and m["content"])]
        return keep + [{"role": "user", "content": user_text}]

    def set_system(self, text: str | None) -> None:
        """The system prompt from the next reply on, as a message after the ones so far."""
        self.messages.append({"role": "system", "content": text or ""})

    @property
    def system_in_force(self) -> str | None:
        """The system prompt the next reply gets."""
        turn = next((m["content"] for m in reversed(self.messages) if m["role"] == "system"), None)
        return (turn or None) if turn is not None else self.system

    def last(self, role: str) -> str | None:
        """The latest message of ``role`` ("user" or "assistant"), if any."""
        return next((m["content"] for m in reversed(self.messages) if m["role"] == role), None)

