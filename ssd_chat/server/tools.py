"""Tools (function calling) for models whose chat template shows them to the model.

The offered tools go to the chat template (``apply_chat_template(..., tools=...)``, Hugging
Face's convention, which Qwen's and Llama 3.1's templates read); the reply is text, and the
calls are read back from it in the two formats those models are trained on:

* Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, anywhere
  in the reply, with text around them as the message content;
* Llama 3.1 (JSON-based calling): the whole reply is ``{"name": ..., "parameters": {...}}``
  (several separated by ``;``), optionally after ``<|python_tag|>``; only names of offered
  tools count, so a reply that merely is JSON stays text.

A reply with calls ends with ``finish_reason: "tool_calls"``, as OpenAI's does.  A template
that does not read ``tools`` cannot show them to the model: the server refuses such requests
(or, with ``serve --ignore-tools``, answers them in text), never dropping them silently.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_PYTHON_TAG = "<|python_tag|>"


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads the ``tools`` variable."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):  # named templates: transformers picks "tool_use" when tools are given
        return "tool_use" in t or any(isinstance(v, str) and "tools" in v for v in t.values())
    return isinstance(t, str) and re.search(r"\btools\b", t) is not None


def _call(obj: Any, names: set[str] | None) -> dict[str, Any] | None:
    """One OpenAI ``tool_calls`` entry from a parsed object, or None if it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or (names is not None and obj["name"] not in names):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def _json_calls(text: str, names: set[str]) -> list[dict[str, Any]]:
    """Llama 3.1's format: the text is nothing but call objects (``;`` or whitespace between)."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return []
        call = _call(obj, names)
        if call is None:
            return []
        calls.append(call)
        while i < len(body) and (body[i].isspace() or body[i] == ";"):
            i += 1
    return calls


def parse(text: str, names: set[str], whole: bool = True) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a reply; no calls: the text unchanged.  ``whole``: ``text`` is the
    entire reply (the Llama format needs that)."""
    if OPEN in text:
        calls, content = [], text
        for m in _BLOCK.finditer(text):
            try:
                call = _call(json.loads(m.group(1)), None)
            except ValueError:
                call = None
            if call is not None:
                calls.append(call)
                content = content.replace(m.group(0), "", 1)
        return ((content.strip() or None), calls) if calls else (text, [])
    calls = _json_calls(text, names) if whole else []
    return (None, calls) if calls else (text, [])


class ToolStream:
    """Streamed content, held back from where a tool call may begin: a ``<tool_call>`` (or a
    prefix of it at the end so far), or a reply that opens with ``{`` (Llama's format)."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.text, self.shown, self.held = names, "", 0, False

    def feed(self, delta: str) -> str:
        """The part of ``delta`` (with anything held before) that is content for sure."""
        self.text += delta
        if self.held:
            return ""
        rest = self.text[self.shown:]
        if not self.text[:self.shown].strip() and rest.lstrip().startswith(("{", _PYTHON_TAG)):
            self.held = True
            return ""
        i = rest.find(OPEN)
        if i >= 0:
            self.held = True
        else:  # keep back the longest tail that could still grow into "<tool_call>"
            i = len(rest)
            for n in range(min(len(OPEN) - 1, len(rest)), 0, -1):
                if OPEN.startswith(rest[-n:]):
                    i = len(rest) - n
                    break
        self.shown += i
        return rest[:i]

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content not yet sent, tool calls) once the reply has ended."""
        rest = self.text[self.shown:]
        content, calls = parse(rest, self.names, whole=not self.text[:self.shown].strip())
        return (content or None) if calls else (rest or None), calls


def finish_reason(done_reason: str, calls: list[dict[str, Any]]) -> str:
    return "tool_calls" if calls else "length" if done_reason == "length" else "stop"


def stream_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as one streamed delta's ``tool_calls`` (each whole, with its index)."""
    return [{"index": i, **c} for i, c in enumerate(calls)]
