"""ReplyBuilder: incremental text, multi-byte characters, stop strings, EOS, budget."""

from __future__ import annotations

import pytest

from ssd_chat.engine.decode.detok import ReplyBuilder


def feed(builder, ids):
    deltas = []
    for i in ids:
        deltas.append(builder.push(i))
        if builder.finished:
            break
    return deltas


@pytest.mark.parametrize("text", ["héllo wörld ✓ 你好世界 🦙🚀 ok", "naïve café — “quotes” …", "  leading spaces\n\ttabs"])
def test_incremental_text_equals_full_decode(smol_tokenizer, text):
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    b = ReplyBuilder(smol_tokenizer, frozenset(), max_new_tokens=10_000)
    deltas = feed(b, ids)
    assert "".join(deltas) == b.text == smol_tokenizer.decode(ids)
    assert not any("\ufffd" in d for d in deltas)  # no split multi-byte character ever released


def test_emoji_bytes_are_held_until_complete(smol_tokenizer):
    ids = smol_tokenizer("🦙", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji into several tokens
    b = ReplyBuilder(smol_tokenizer, frozenset())
    deltas = feed(b, ids)
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "🦙"


def test_stop_string_spanning_tokens(smol_tokenizer):
    text = "The answer is 42. END of story"
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    b = ReplyBuilder(smol_tokenizer, frozenset(), stop=("END",))
    deltas = feed(b, ids)
    assert b.reason == "stop"
    assert b.text == "The answer is 42. " and "".join(deltas) == b.text


def test_partial_stop_prefix_is_released_when_it_does_not_match(smol_tokenizer):
    ids = smol_tokenizer("a <|x> b", add_special_tokens=False)["input_ids"]
    b = ReplyBuilder(smol_tokenizer, frozenset(), stop=("<|xyz|>",), max_new_tokens=len(ids))
    deltas = feed(b, ids)
    assert b.reason == "length" and "".join(deltas) == "a <|x> b" == b.text


def test_eos_and_budget(smol_tokenizer):
    ids = smol_tokenizer("one two three", add_special_tokens=False)["input_ids"]
    b = ReplyBuilder(smol_tokenizer, frozenset({ids[1]}))
    feed(b, ids)
    assert b.reason == "eos" and b.token_ids == ids[:1]
    b = ReplyBuilder(smol_tokenizer, frozenset(), max_new_tokens=2)
    feed(b, ids)
    assert b.reason == "length" and b.token_ids == ids[:2] and b.remaining == 0
    with pytest.raises(RuntimeError):
        b.push(ids[2])
