"""A saved chat as text: Markdown (``chats show``, the app's export), JSON Lines and one JSON document,
each with its messages in order, the system prompt where it was set, and each reply's metrics.
By default they hold the chat's current branch; given ``tree`` (the ids on the current branch), every
message, oldest first, each with its id and the id of the message it follows.

Kept apart from :mod:`ssd_chat.history.store` (the store): these take a chat and its messages, as read there.
"""

from __future__ import annotations

import json
import time
from typing import Any

FORMATS = {"md": "Markdown", "jsonl": "JSON Lines", "json": "JSON"}
SUFFIXES = {".md": "md", ".markdown": "md", ".jsonl": "jsonl", ".json": "json"}


def _where(m: Any, tree: set[int] | None) -> str:
    if tree is None:
        return ""
    after = f" after #{m.parent_id}" if m.parent_id is not None else ""
    return f" [#{m.id}{after}{', current branch' if m.id in tree else ''}]"


def markdown(conv: Any, messages: list[Any], tree: set[int] | None = None) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conv.created_at))
    lines = [f"# {conv.title}", "", f"_ssd-chat conversation {conv.id}, {when}_", ""]
    if tree is not None:
        lines += ["_Every branch: each message names the one it follows._", ""]
    for m in messages:
        if m.role == "system":  # in force from here on, for the replies that follow it
            text = f"**System prompt:** {m.content}" if m.content else "**System prompt cleared**"
            lines += [text + _where(m, tree), ""]
            continue
        who = {"user": "You", "assistant": "Assistant"}.get(m.role, m.role.title())
        lines += [f"## {who}" + ("" if m.status == "done" else f" ({m.status})") + _where(m, tree), "", m.content, ""]
        if m.metrics:
            lines += [f"> {metrics_line(m.metrics)}", ""]
    return "\n".join(lines)


def _message(m: Any, tree: set[int] | None = None) -> dict[str, Any]:
    d = {"role": m.role, "content": m.content, "status": m.status, "created_at": m.created_at, "metrics": m.metrics}
    if tree is not None:
        d.update(id=m.id, parent_id=m.parent_id, current=m.id in tree)
    return d


def jsonl(conv: Any, messages: list[Any], tree: set[int] | None = None) -> str:
    rows: list[dict[str, Any]] = [{"type": "conversation", "id": conv.id, "title": conv.title, "created_at": conv.created_at}]
    rows += [{"type": "message", **_message(m, tree)} for m in messages]
    return "\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n"


def json_document(conv: Any, messages: list[Any], tree: set[int] | None = None) -> str:
    doc = {"id": conv.id, "title": conv.title, "created_at": conv.created_at, "messages": [_message(m, tree) for m in messages]}
    return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"


def mode_column(d: dict[str, Any]) -> str | None:
    """The stored mode: the configured mode, or ``ssd→sd`` when the reply switched."""
    mode, ran = d.get("mode"), d.get("ran_as")
    return f"{mode}→{ran}" if ran and ran != mode else mode


def metrics_line(m: dict[str, Any]) -> str:
    """One line for a stored turn's metrics (the same fields the panel shows)."""
    from ..engine import mode_label  # here: importing the engine package loads torch

    mode, n = m.get("mode"), m.get("new_tokens", 0)
    parts = [mode_label(mode, m.get("ran_as"), m.get("switched_after")).lower() if mode else "?", f"{n} token{'' if n == 1 else 's'}"]
    for label, key, spec, suffix in (("", "tok_per_s", ".1f", " tok/s"), ("TTFT ", "ttft_s", ".2f", " s"),
                                     ("τ ", "mean_accepted_length", ".2f", ""), ("acceptance ", "acceptance_rate", ".0%", ""),
                                     ("cache hits ", "cache_hit_rate", ".0%", "")):
        if m.get(key) is not None:
            parts.append(label + format(m[key], spec) + suffix)
    return ", ".join(parts)
