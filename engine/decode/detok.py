"""Turning accepted token ids into reply text, and deciding when the reply ends.

One :class:`ReplyBuilder` per reply, shared by AR, SD and SSD so that EOS, stop
strings and the token budget behave identically in every mode.
"""

from __future__ import annotations

from typing import Literal, Protocol

EndReason = Literal["eos", "stop", "length"]


class _Tokenizer(Protocol):  # the part of a transformers tokenizer we use
    def decode(self, ids: list[int], skip_special_tokens: bool = ..., clean_up_tokenization_spaces: bool = ...) -> str: ...


class ReplyBuilder:
    """Accumulates a reply token by token.

    Text is produced incrementally (the prefix/read-offset method of TGI and vLLM): a
    delta is released only when it does not end in an incomplete UTF-8 sequence, so
    a multi-byte character is never split.  Text that could be the start of a stop
    string is held back until it is clear it is not.
    """

    # Not tokenizers' DecodeStream: same deltas, but it needs a Rust tokenizer (bench's simulated and slow ones have only decode())

    def __init__(
        self,
        tokenizer: _Tokenizer,
        eos_ids: set[int] | frozenset[int],
        stop: tuple[str, ...] = (),
        max_new_tokens: int = 512,
        ignore_eos: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._eos = frozenset() if ignore_eos else frozenset(eos_ids)
        self._stop = tuple(stop)
        self._max = max_new_tokens
        self.token_ids: list[int] = []
        self.text = ""  # released text
        self._pending = ""  # decoded but held back (possible stop-string prefix)
        self._prefix_offset = 0
        self._read_offset = 0
        self.reason: EndReason | None = None
        # the EOS token that ended the reply, with its logprob and alternatives (when a request asked for logprobs)
        self.eos_logprob: tuple[int, float, tuple[tuple[int, float], ...]] | None = None

    @property
    def finished(self) -> bool:
        return self.reason is not None

    @property
    def remaining(self) -> int:
        """How many more tokens the budget allows."""
        return self._max - len(self.token_ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases.  Check :attr:`finished` after."""
        if self.reason is not None:
            raise RuntimeError("push() after the reply finished")
        if token_id in self._eos:
            self.reason = "eos"
            return self._flush()
        self.token_ids.append(int(token_id))
        self._pending += self._decode_delta()
        released = self._check_stop()
        if self.reason is None and len(self.token_ids) >= self._max:
            self.reason = "length"
            released += self._flush()
        return released

    def flush(self) -> str:
        """Release held-back text (call when the reply is cut short, e.g. cancelled)."""
        return self._flush()

    # -- internals --------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_delta(self) -> str:
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            return new_text[len(prefix_text) :]
        return ""

    def _check_stop(self) -> str:
        if not self._stop:
            return self._flush()
        longest = max(len(s) for s in self._stop)
        # search the tail of released text plus everything pending
        start = max(0, len(self.text) - longest + 1)
        window = self.text[start:] + self._pending
        hits = [window.find(s) for s in self._stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            cut = start + min(hits)  # absolute index in text + pending where the stop string starts
            full = self.text + self._pending
            released = full[len(self.text) : cut] if cut > len(self.text) else ""
            self.text = full[: max(cut, len(self.text))]
            self._pending = ""
            self.reason = "stop"
            return released
        # hold back the longest pending suffix that is a prefix of a stop string
        hold = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        released = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(self._pending) - hold :]
        self.text += released
        return released

    def _flush(self) -> str:
        released, self._pending = self._pending, ""
        self.text += released
        return released
