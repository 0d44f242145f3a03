"""Conversations -> prompt token ids, through the tokenizer's chat template.

A model without a chat template (a base model) gets this documented plain format::

    System: <system prompt>

    User: <message>

    Assistant: <reply>

    User: <message>

    Assistant:

and ``"\\nUser:"`` is added to the stop strings so the reply ends where the next turn would begin.
"""

from __future__ import annotations

from typing import Any

PLAIN_STOP = ("\nUser:",)
_ROLE = {"system": "System", "user": "User", "assistant": "Assistant"}


def plain_format(messages: list[dict[str, str]]) -> str:
    parts = [f"{_ROLE.get(m['role'], m['role'].title())}: {m['content']}" for m in messages]
    return "\n\n".join(parts + ["Assistant:"])


def prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> tuple[list[int], tuple[str, ...]]:
    """Token ids for the next assistant reply, and stop strings the format needs (``tools``: OpenAI
    tool definitions, for a template that shows them to the model)."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), ()
    ids = tokenizer(plain_format(messages), add_special_tokens=True)["input_ids"]
    return list(ids), PLAIN_STOP


def messages_for(prompt: str, system: str | None = None, history: list[dict[str, str]] | None = None) -> list[dict[str, str]]:
    msgs: list[dict[str, str]] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.extend(history or [])
    msgs.append({"role": "user", "content": prompt})
    return msgs
