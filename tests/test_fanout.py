"""Fan-out policies: uniform, Saguaro's geometric series under a budget, explicit lists."""

from __future__ import annotations

import pytest

from ssd_chat.engine.errors import ParamError
from ssd_chat.engine.fanout import (
    BYTES_PER_ROW_ENTRY,
    MAX_BUDGET,
    TREE_BYTES,
    default_budget,
    geometric,
    max_budget,
    parse,
)


@pytest.mark.parametrize(("k", "budget", "a"), [(7, 24, 0.8), (4, 10, 0.5), (3, 8, 0.95), (5, 6, 0.2), (2, 100, 0.7)])
def test_geometric_sums_to_budget_and_follows_theorem_12(k, budget, a):
    f = geometric(k, budget, a)
    assert len(f) == k + 1 and sum(f) == budget and min(f) >= 0
    # the real-valued optimum; every integer is within one of it (largest-remainder rounding)
    w = [a ** (j / 2) for j in range(k)] + [a ** (k / 2) * (1 - a) ** -0.5]
    exact = [budget * x / sum(w) for x in w]
    assert all(abs(fi - e) < 1 for fi, e in zip(f, exact)), (f, exact)
    assert all(f[j] >= f[j + 1] for j in range(k - 1))  # non-increasing before the all-accepted term


def test_geometric_worked_example():
    # spec §3.1: K=7, B=24, a=0.8, r=1; exact shares 3.90 3.49 3.12 2.79 2.49 2.23 2.00 3.99
    assert geometric(7, 24, 0.8) == [4, 3, 3, 3, 3, 2, 2, 4]


def test_geometric_shifts_budget_with_acceptance():
    hi, lo = geometric(4, 10, 0.9), geometric(4, 10, 0.2)
    assert hi[-1] > lo[-1] and hi[0] < lo[0]  # likely all-accepted: more guesses at j = k


def test_cap_limits_each_entry():
    assert geometric(2, 100, 0.5, cap=7) == [7, 7, 7]


def test_online_estimates_are_separate_for_hits_and_misses():
    f = parse("geometric", 4, 10)
    for _ in range(20):
        f.observe(4, was_hit=True)  # everything accepted after hits
        f.observe(0, was_hit=False)  # nothing accepted after misses
    hit, miss = f.lists()
    assert sum(hit) == sum(miss) == 10
    assert hit[-1] > miss[-1] and miss[0] > hit[0]


def test_parse_forms():
    assert parse("uniform:3", 2).lists() == ([3, 3, 3], [3, 3, 3])
    assert parse(" 3,2,1 ", 2).lists() == ([3, 2, 1], [3, 2, 1])
    assert parse("3,2,1/1,1,4", 2).lists() == ([3, 2, 1], [1, 1, 4])
    g = parse(None, 4)
    assert g.kind == "geometric" and g.budget == default_budget(4) and sum(g.lists()[0]) == g.budget
    assert parse("geometric", 4, 7).budget == 7
    assert parse("uniform:9", 2, vocab_size=5).lists()[0] == [4, 4, 4]


@pytest.mark.parametrize(("spec", "budget", "msg"), [
    ("uniform:0", None, "F >= 1"),
    ("uniform:2", 7, "budget"),
    ("1,2", None, "k\\+1"),
    ("0,0,0", None, "caches nothing"),
    ("3,2,1", 5, "budget"),
    ("fancy", None, "unknown fan-out"),
    ("geometric", 0, "at least 1"),
])
def test_parse_errors_are_one_line(spec, budget, msg):
    with pytest.raises(ParamError, match=msg) as e:
        parse(spec, 2, budget)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("spec", "budget", "k", "vocab", "msg"), [
    ("geometric", 1000, 2, None, "at most 256"),
    ("geometric", MAX_BUDGET + 1, 2, None, "at most 256"),
    ("uniform:100", None, 2, None, "uniform:100 .* B=300 .*at most 256"),
    ("uniform:99999999999999999999", None, 2, None, "at most 256"),
    ("200,200,1", None, 2, None, "sum B=401"),
    ("1,1,1/200,200,1", None, 2, None, "sum B=401"),
    # Qwen2.5's 152,064 tokens at k=32: 64 branches would hold 2.3 GiB of q' and logits rows
    ("geometric", 64, 32, 152_064, "2.3 GiB .* at most 55"),
])
def test_the_tree_is_bounded_and_the_error_says_the_bound(spec, budget, k, vocab, msg):
    with pytest.raises(ParamError, match=msg) as e:
        parse(spec, k, budget, vocab)
    assert "\n" not in str(e.value)


def test_the_bounds_in_bytes():
    assert parse("geometric", 2, MAX_BUDGET, 49_152).budget == MAX_BUDGET  # the packaged SmolLM2: only the cap binds
    most = max_budget(32, 152_064)
    assert most * 32 * 152_064 * BYTES_PER_ROW_ENTRY <= TREE_BYTES < (most + 1) * 32 * 152_064 * BYTES_PER_ROW_ENTRY
    assert parse("geometric", 32, most, 152_064).budget == most
    # the default budget 2(k+1) = 66 shrinks to fit rather than fail when nobody asked for it
    assert parse(None, 32, None, 152_064).budget == most < default_budget(32)


def test_engine_config_refuses_an_unbounded_budget_before_loading():
    from ssd_chat.engine import EngineConfig

    with pytest.raises(ParamError, match="at most 256"):
        EngineConfig(mode="ssd", budget=1000)
    with pytest.raises(ParamError, match="at most 256"):
        EngineConfig(mode="ssd", fan_out="uniform:1000")
