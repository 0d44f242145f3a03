"""The event stream's JSONL form round-trips, and Metrics computes the documented formulas."""

from __future__ import annotations

import json

from ssd_chat.engine.events import Done, Error, Notice, Round, Stats, Token, from_dict, to_dict
from ssd_chat.engine.metrics import Metrics


def test_jsonl_round_trip():
    stats = Metrics("ssd").stats(1.0)
    evs = [
        Token(5, "hé", "draft", 0.25),
        Round(0, (5, 6, 7), 2, 9, 3, 0.01, 0.02, 0.3, True, ((0, (1, 2)), (1, (3,))), 0.001, 0.015, None),
        Notice("speculator restarted", "warning", 0.4),
        Done("eos", "hé", (5,), stats),
        Error("boom", "runtime", "hé", (5,)),
    ]
    back = [from_dict(json.loads(json.dumps(to_dict(e)))) for e in evs]
    assert back == evs


def test_metrics_formulas():
    m = Metrics("ssd")
    rounds = [
        Round(0, (1, 2, 3, 4), 4, 9, 5, 0.0, 0.1, cache_hit=False),
        Round(1, (1, 2, 3, 4), 1, 9, 2, 0.0, 0.1, cache_hit=True),
        Round(2, (1, 2, 3, 4), 3, 9, 4, 0.0, 0.1, cache_hit=True),
    ]
    for i, r in enumerate(rounds):
        m.add(r)
    for i in range(11):
        m.add(Token(i, "x", "target", 1.0 + 0.1 * i))
    s: Stats = m.stats(3.0)
    assert s.mean_accepted_length == 1 + 8 / 3
    assert s.acceptance_rate == 8 / 12
    assert s.per_position_acceptance == (1.0, 2 / 3, 2 / 3, 1 / 3)
    assert s.cache_hit_rate == 2 / 3
    assert s.accepted_length_on_hit == 1 + 4 / 2 and s.accepted_length_on_miss == 1 + 4
    assert abs(s.tok_per_s - 10 / 1.0) < 1e-9 and s.ttft_s == 1.0 and s.new_tokens == 11


def test_the_decode_rate_leaves_out_the_first_block():
    """SD's first round yields its tokens together: they are the prefill's, not the decoding's (a reply of one
    round once showed 12901 tok/s); a reply that is one block has no decode rate."""
    m = Metrics("sd")
    for t in (5, 6, 7):
        m.add(Token(t, "x", "draft", 0.5))
    assert m.stats(0.6).tok_per_s is None and m.stats(0.6).ttft_s == 0.5
    for t in (8, 9):
        m.add(Token(t, "x", "draft", 0.7))
    assert abs(m.stats(0.8).tok_per_s - 2 / 0.2) < 1e-9


def test_an_sd_block_shares_one_time():
    from ssd_chat.engine.decode.decoder import emit_block

    class Builder:
        reason, finished, text = None, False, ""

        def push(self, tok):
            return "x"

    m = Metrics("sd")
    events = list(emit_block(Builder(), m, [1, 2, 3], 2, 9, 0.0))
    assert [e.id for e in events] == [1, 2, 9] and len({e.t_s for e in events}) == 1


def test_from_json_is_strict_and_from_dict_names_what_is_missing():
    import pytest
    from pydantic import ValidationError

    from ssd_chat.engine.events import from_json

    assert from_json('{"type": "Token", "id": 1, "text": "a", "t_s": 1, "newer": 0}') == Token(1, "a", "target", 1.0)
    for bad in ('{"type": "Token", "id": true, "text": "a"}', '{"type": "Token", "id": 1.0, "text": "a"}',
                '{"type": "Token", "id": 1, "text": 5}', '{"type": "Token", "id": 1, "text": "a", "source": "x"}'):
        with pytest.raises(ValidationError):
            from_json(bad)
    with pytest.raises(ValidationError, match="stats"):
        from_dict({"type": "Done", "reason": "eos", "text": "", "token_ids": []})
