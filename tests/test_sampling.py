"""Sampling math on hand-made distributions: masks, residual, the speculative accept/reject rule."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from ssd_chat.engine.sampling.sampling import (
    apply_top_k_top_p,
    logits_to_probs,
    make_generator,
    residual,
    sample,
    sample_next,
    saguaro_reshape,
    verify,
)

P_VALUE_MIN = 1e-3  # significance of every goodness-of-fit test in this file


def _probs(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _fit(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of ``counts`` against ``probs`` (zero-probability cells must be empty)."""
    total = int(counts.sum())
    support = probs > 0
    assert int(counts[~support].sum()) == 0, f"impossible outcomes drawn: {counts.tolist()}"
    expected = probs[support].double()
    expected = expected / expected.sum() * total
    return float(chisquare(counts[support].double().numpy(), expected.numpy()).pvalue)


# -- masks ---------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0, 0.5], [5.0, 4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k_top_p(logits, top_k=2)
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False], [True, True, False, False, False]]
    assert torch.equal(out[torch.isfinite(out)], logits[torch.isfinite(out)])  # survivors unchanged


def test_top_k_off_or_at_least_vocab_is_identity():
    logits = torch.randn(3, 7)
    assert torch.equal(apply_top_k_top_p(logits, top_k=0), logits)
    assert torch.equal(apply_top_k_top_p(logits, top_k=7), logits)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = _probs(0.05, 0.5, 0.3, 0.15)
    logits = probs.log()
    # 0.5 + 0.3 = 0.8 < 0.85 -> 0.15 is needed too; 0.05 is not
    kept = torch.isfinite(apply_top_k_top_p(logits, top_p=0.85))
    assert kept.tolist() == [False, True, True, True]
    # exactly reaching p: 0.5 + 0.3 >= 0.8 -> stop there
    kept = torch.isfinite(apply_top_k_top_p(logits, top_p=0.8))
    assert kept.tolist() == [False, True, True, False]


def test_top_p_tiny_keeps_the_most_likely_token():
    logits = _probs(0.2, 0.1, 0.7).log()
    assert torch.isfinite(apply_top_k_top_p(logits, top_p=1e-6)).tolist() == [False, False, True]


def test_logits_to_probs_renormalises_the_survivors():
    logits = _probs(0.05, 0.5, 0.3, 0.15).log()
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert torch.allclose(p, _probs(0, 0.5 / 0.8, 0.3 / 0.8, 0))
    p = logits_to_probs(logits, 1.0, top_p=0.85)
    assert torch.allclose(p, _probs(0, 0.5, 0.3, 0.15) / 0.95)


def test_logits_to_probs_temperature_and_greedy():
    logits = torch.tensor([1.0, 2.0, 0.0])
    assert torch.allclose(logits_to_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    assert logits_to_probs(logits, 0.0).tolist() == [0.0, 1.0, 0.0]
    # greedy ignores top-k / top-p
    assert logits_to_probs(logits, 0.0, top_k=1, top_p=0.1).tolist() == [0.0, 1.0, 0.0]
    assert sample_next(logits, 0.0, 0, 1.0, make_generator(0)) == 1


# -- residual ------------------------------------------------------------------------


def test_residual_is_the_normalised_positive_part():
    p, q = _probs(0.5, 0.3, 0.2), _probs(0.2, 0.5, 0.3)
    assert torch.allclose(residual(p, q), _probs(1.0, 0.0, 0.0))
    p, q = _probs(0.4, 0.4, 0.2), _probs(0.1, 0.2, 0.7)
    assert torch.allclose(residual(p, q), _probs(0.3, 0.2, 0.0) / 0.5)


def test_residual_falls_back_to_p_when_p_equals_q():
    p = _probs(0.25, 0.75)
    assert torch.equal(residual(p, p.clone()), p)


def test_residual_batched_rows_are_independent():
    p = torch.stack([_probs(0.5, 0.5), _probs(0.9, 0.1)])
    q = torch.stack([_probs(0.5, 0.5), _probs(0.1, 0.9)])
    assert torch.allclose(residual(p, q), torch.stack([_probs(0.5, 0.5), _probs(1.0, 0.0)]))


# -- verify: deterministic cases -----------------------------------------------------


def test_verify_greedy_accepts_the_matching_prefix_and_returns_the_target_argmax():
    V = 5
    p = torch.nn.functional.one_hot(torch.tensor([2, 4, 1, 3]), V).float()  # target argmaxes 2, 4, 1 (+3 after)
    for drafts, expected in [([2, 4, 1], (3, 3)), ([2, 4, 0], (2, 1)), ([0, 4, 1], (0, 2)), ([2, 3, 1], (1, 4))]:
        d = torch.tensor(drafts)
        q = torch.nn.functional.one_hot(d, V).float()
        assert verify(d, q, p, make_generator(0)) == expected


def test_verify_with_q_equal_p_accepts_everything():
    gen = make_generator(1)
    p = torch.softmax(torch.randn(4, 6, generator=gen), -1)
    for seed in range(50):
        g = make_generator(seed)
        d = sample(p[:3], g)
        n, bonus = verify(d, p[:3].clone(), p, g)
        assert n == 3 and 0 <= bonus < 6


def test_verify_rejects_tokens_the_target_cannot_produce():
    p = torch.stack([_probs(0.0, 0.5, 0.5), _probs(0.2, 0.4, 0.4)])
    q = _probs(0.9, 0.05, 0.05)[None]
    for seed in range(50):
        n, bonus = verify(torch.tensor([0]), q, p, make_generator(seed))
        assert n == 0 and bonus != 0  # the bonus comes from the residual, which has no mass on token 0


def test_verify_with_no_drafts_samples_from_p():
    p = _probs(0.0, 0.0, 1.0)[None]
    assert verify(torch.tensor([], dtype=torch.long), p[:0], p, make_generator(0)) == (0, 2)


# -- verify: distribution ------------------------------------------------------------


def _first_token_counts(p: torch.Tensor, q: torch.Tensor, num: int, seed: int, wrong: bool = False) -> torch.Tensor:
    """Draw the draft from q, run verify, record the first output token (accepted draft or bonus)."""
    gen = make_generator(seed)
    counts = torch.zeros(p.shape[-1], dtype=torch.long)
    for _ in range(num):
        d = sample(q, gen)  # [k]
        n, bonus = verify(d, q, p, gen)
        if wrong and n < d.shape[0]:  # a broken verifier: bonus from p instead of the residual
            bonus = int(sample(p[n], gen))
        counts[int(d[0]) if n > 0 else bonus] += 1
    return counts


P_HAND = torch.stack([_probs(0.1, 0.6, 0.1, 0.2), _probs(0.25, 0.25, 0.25, 0.25)])  # [k+1=2, V=4]
Q_HAND = _probs(0.5, 0.1, 0.3, 0.1)[None]  # [k=1, V]


def test_verify_output_is_distributed_as_p():
    counts = _first_token_counts(P_HAND, Q_HAND, 4000, seed=0)
    assert _fit(counts, P_HAND[0]) > P_VALUE_MIN, counts


def test_verify_distribution_check_catches_a_wrong_residual():
    counts = _first_token_counts(P_HAND, Q_HAND, 4000, seed=0, wrong=True)
    assert _fit(counts, P_HAND[0]) < P_VALUE_MIN, counts


def test_verify_is_exact_for_a_saguaro_reshaped_proposal():
    q = saguaro_reshape(Q_HAND, c=0.3, num_top=2)
    counts = _first_token_counts(P_HAND, q, 4000, seed=1)
    assert _fit(counts, P_HAND[0]) > P_VALUE_MIN, counts


def test_verify_second_position_distribution():
    """P(second token | first token) must be p's second row when the first was an accepted draft."""
    p = torch.stack([_probs(0.7, 0.3, 0.0), _probs(0.2, 0.3, 0.5), _probs(1 / 3, 1 / 3, 1 / 3)])
    q = torch.stack([_probs(0.6, 0.4, 0.0), _probs(0.6, 0.2, 0.2)])
    gen = make_generator(3)
    counts = torch.zeros(3, dtype=torch.long)
    for _ in range(4000):
        d = sample(q, gen)
        n, bonus = verify(d, q, p, gen)
        if n >= 1 and int(d[0]) == 0:  # condition on token 0 first (accepted draft)
            counts[int(d[1]) if n >= 2 else bonus] += 1
    assert counts.sum() > 1000
    assert _fit(counts, p[1]) > P_VALUE_MIN, counts


# -- Saguaro reshape -----------------------------------------------------------------


def test_saguaro_reshape_scales_the_top_tokens():
    q = _probs(0.5, 0.1, 0.3, 0.1)
    assert torch.equal(saguaro_reshape(q, 1.0, 2), q)
    assert torch.equal(saguaro_reshape(q, 0.5, 0), q)
    r = saguaro_reshape(q, 0.5, 2)  # tokens 0 and 2 halved
    assert torch.allclose(r, _probs(0.25, 0.1, 0.15, 0.1) / 0.6)


@pytest.mark.parametrize("seed", [None, 7])
def test_make_generator(seed):
    a, b = make_generator(seed), make_generator(seed)
    x, y = torch.rand(3, generator=a), torch.rand(3, generator=b)
    assert torch.equal(x, y) == (seed is not None)
