"""Sampling at temperature > 0 through a two-rank tensor-parallel target (gloo on the CPU): the output
distribution is the target's (tests/distribution.py), and the check fails when the logits are wrong."""

from __future__ import annotations

import pytest
import torch

from ssd_chat.engine.model.core import Core
from ssd_chat.engine.params import SamplingParams

from helpers.models import CharTokenizer, as_loaded, tiny_llama
from helpers.distribution import compare, exact_distribution, sample_outcomes
from helpers.tp import ar_stream, greedy, save as _save, sd_stream, start as _start

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Vocabulary 8 (so the exact distribution of 3 tokens is enumerable), a TP target and a draft core."""
    tok = CharTokenizer(8)
    model = tiny_llama(vocab_size=8, seed=0, hidden=32)
    tp = _start(_save(model, tmp_path_factory.mktemp("t8")))
    yield as_loaded(model, tok, "t8"), tp, Core(tiny_llama(vocab_size=8, seed=3, hidden=32, layers=1), "d8")
    tp.close()


def test_sd_with_a_tensor_parallel_target_samples_the_target_distribution(small):
    target, tp, draft = small
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, [1, 2, 3], 3, params)
    result = compare(sample_outcomes(sd_stream(tp, draft, 3), [1, 2, 3], params, 3, 800), exact)
    assert result.p_value > 1e-3, result
    greedy_sd = sample_outcomes(sd_stream(tp, draft, 3), [1, 2, 3], SamplingParams(temperature=0.0), 8, 1)
    assert list(greedy_sd) == [tuple(greedy(Core(target.model, "t8"), [1, 2, 3], 8))]


@pytest.mark.slow
def test_ar_sampling_through_the_tensor_parallel_logits(small):
    target, tp, _ = small
    params = SamplingParams(temperature=0.8, top_p=0.9)
    exact = exact_distribution(target, [1, 2, 3], 2, params)
    assert compare(sample_outcomes(ar_stream(tp), [1, 2, 3], params, 2, 1000), exact).p_value > 1e-3


def test_the_distribution_check_fails_when_the_head_gathers_wrongly(small, monkeypatch):
    """The same check must fail if rank 0 put the two vocabulary blocks in the wrong order."""
    target, tp, _ = small
    head = tp.core.head
    real = head._gather
    monkeypatch.setattr(head, "_gather", lambda local: real(local).roll(4, dims=-1))
    params = SamplingParams(temperature=1.0)
    exact = exact_distribution(target, [1, 2, 3], 2, params)
    assert compare(sample_outcomes(ar_stream(tp), [1, 2, 3], params, 2, 400), exact).p_value < 1e-3


