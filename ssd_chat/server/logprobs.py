"""Logprobs as OpenAI and vLLM shape them: chat completions' ``logprobs.content`` entries
(``token``, ``logprob``, ``bytes``, ``top_logprobs``) and legacy completions' parallel lists
(``tokens``, ``token_logprobs``, ``top_logprobs`` dicts, ``text_offset``).

A token's text is its own bytes (byte-level BPE pieces mapped back through GPT-2's byte table), so
``bytes`` is exact even for a token that holds part of a character; its ``token`` string is those
bytes decoded with U+FFFD for an incomplete character, as vLLM's.  The values are the target's raw
logprobs (:mod:`engine.decode.logprobs`).
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any



def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable bytes stand for themselves, the others for
    chr(256 + n), in byte order; maps each character back to its byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + n): b for n, b in enumerate(others)}}


_BYTES = _byte_table()


class TokenTexts:
    """Each token id's (text, bytes), from a private copy of the tokenizer (safe on the event loop)."""

    def __init__(self, tokenizer: Any) -> None:
        try:
            self._tok = copy.deepcopy(tokenizer)
        except Exception:  # noqa: BLE001 - slow tokenizers are pure Python and may be shared
            self._tok = tokenizer
        self._lock = threading.Lock()

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per server, lives as long as it
    def piece(self, tid: int) -> tuple[str, list[int]]:
        with self._lock:
            raw = self._tok.convert_ids_to_tokens(tid) if hasattr(self._tok, "convert_ids_to_tokens") else None
            if isinstance(raw, str) and raw and all(c in _BYTES for c in raw):
                data = bytes(_BYTES[c] for c in raw)
            else:  # not byte-level BPE (SentencePiece, test tokenizers): the token's decoded text
                data = self._tok.decode([tid], skip_special_tokens=False).encode("utf-8")
        return data.decode("utf-8", errors="replace"), list(data)


def chat_content(texts: TokenTexts, tokens: list[tuple[int, float, Any]]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or chunk) for (id, logprob, top) triples."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text, data = texts.piece(tid)
        return {"token": text, "logprob": lp, "bytes": data}

    return {"content": [{**entry(tid, lp), "top_logprobs": [entry(i, v) for i, v in top or ()]} for tid, lp, top in tokens],
            "refusal": None}


class CompletionLogprobs:
    """``choices[i].logprobs`` of a legacy completion, built token by token (vLLM's shape: the top
    dict also holds the chosen token; an echoed prompt's first token has null logprobs)."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts, self.offset = texts, offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, tid: int, value: tuple[float, Any] | None) -> None:
        text = self.texts.piece(tid)[0]
        self.tokens.append(text)
        self.text_offset.append(self.offset)
        self.offset += len(text)
        if value is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        lp, top = value
        self.token_logprobs.append(lp)
        alts = {self.texts.piece(i)[0]: v for i, v in top or ()}
        alts.setdefault(text, lp)
        self.top_logprobs.append(alts)

    def take(self) -> dict[str, Any]:
        """What was added since the last take (a stream's chunk), or all of it (a whole answer)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
