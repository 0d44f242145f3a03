"""The fast sampler (top-k before the softmax, penalties as index operations, draws by inverse CDF)
against the distribution written out plainly over the whole vocabulary (:mod:`reference_sampling`):
random logits, histories and settings, ties at the k-th place, exact top-p boundaries.  Planted bugs
(top-p before the temperature, a penalty applied once per occurrence, ...) disagree on these cases."""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from helpers import reference_sampling as ref
from ssd_chat.engine.sampling import support
from ssd_chat.engine.sampling.penalties import Penalties
from ssd_chat.engine.sampling.sampling import draw_draft, logits_to_probs, make_generator, sample, sample_next

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(rng: random.Random, vocab: int) -> dict:
    """Random logits [R, V], a history with repeated ids, a chain of uncommitted tokens, settings."""
    torch.manual_seed(rng.randrange(1 << 30))
    rows = rng.randint(1, 3)
    if rng.random() < 0.3:  # few distinct values: ties everywhere, across the k-th place too
        logits = torch.randint(-4, 5, (rows, vocab)).float() * 0.5
    else:
        logits = torch.randn(rows, vocab) * rng.choice([0.5, 2.0, 5.0])
    few = rng.sample(range(vocab), 12)  # ids drawn from a small pool repeat
    return dict(
        logits=logits,
        prompt=[rng.choice(few) for _ in range(rng.randint(0, 10))],
        reply=[rng.choice(few) for _ in range(rng.randint(0, 10))],
        chain=[rng.choice(few) for _ in range(rng.randint(rows - 1, rows + 1))],
        start=rng.randint(0, 1),
        temperature=rng.choice([0.0, 0.3, 0.8, 1.0, 1.7]),
        top_k=rng.choice([0, 1, 3, 40, vocab - 1, vocab]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.1]),
        pen=rng.choice([(1.0, 0.0, 0.0), (1.1, 0.0, 0.0), (1.5, 0.5, 0.4), (0.8, -0.3, 0.0), (1.3, 0.7, -0.2)]),
    )


def _engine(c: dict) -> torch.Tensor:
    pen = Penalties(*c["pen"], prompt=c["prompt"])
    pen.add(c["reply"])
    rows = pen.rows(c["logits"], c["chain"], c["start"])
    return logits_to_probs(rows, c["temperature"], c["top_k"], c["top_p"])


def _reference(c: dict, penalized=ref.penalized, probs=ref.probs) -> tuple[torch.Tensor, float]:
    out, margin = [], math.inf
    for r, row in enumerate(c["logits"]):
        x = penalized(row, c["prompt"], c["reply"] + c["chain"][: c["start"] + r], *c["pen"])
        p, m = probs(x, c["temperature"], c["top_k"], c["top_p"])
        out.append(p)
        margin = min(margin, m)
    return torch.stack(out), margin


CASES = ref.cases(100, 0, lambda rng: _case(rng, rng.choice([64, 300, 300, support.BLOCK * 170])), _reference)


def test_the_fast_sampler_gives_the_reference_distribution():
    fast = 0
    for i, c in enumerate(CASES):
        got = _engine(c)
        want = c["want"]
        assert ref.agrees(got, want), (i, {k: v for k, v in c.items() if k not in ("logits", "want")})
        if c["temperature"] > 0:
            pen = Penalties(*c["pen"], prompt=c["prompt"])
            pen.add(c["reply"])
            rows = pen.rows(c["logits"], c["chain"], c["start"])
            fast += support.top_support(rows.float(), c["temperature"], c["top_k"], c["top_p"]) is not None
            tok, q = draw_draft(rows, c["temperature"], c["top_k"], c["top_p"], make_generator(i))
            assert ref.agrees(q, want) and bool((want.gather(-1, tok[:, None]) > 0).all())
            assert want[0, sample_next(rows[0], c["temperature"], c["top_k"], c["top_p"], make_generator(i))] > 0
    assert 20 < fast < len(CASES) - 20  # both the support path and the dense one were checked


def _temperature_tie(t: float) -> tuple[float, float]:
    """Two float32 logits a > b with a / t == b / t in float32."""
    a = torch.tensor(3.0)
    for _ in range(1000):  # neighbours collide where the quotient's spacing is coarser than the logits'
        b = torch.nextafter(a, torch.tensor(0.0))
        if bool(a / t == b / t):
            return float(a), float(b)
        a = torch.nextafter(a, torch.tensor(9.0))
    raise AssertionError("no pair found")


def test_ties_at_the_kth_place_keep_every_tied_token():
    x = torch.full((support.BLOCK * 170,), -5.0)
    x[[9, 400, 7000, 21000]] = 2.0  # four equal logits, the 3rd to the 6th largest
    x[[3, 12000]] = 4.0
    for top_k in (3, 4, 6):
        got = logits_to_probs(x, 1.0, top_k, 1.0)
        assert set(got.nonzero().flatten().tolist()) == {3, 12000, 9, 400, 7000, 21000}, top_k
    a, b = _temperature_tie(0.3)  # unequal logits that the temperature makes equal at the k-th place
    y = torch.full((64,), -9.0)
    y[[5, 40]] = torch.tensor([a, b])
    y[17] = 5.0
    assert set(logits_to_probs(y, 0.3, 2, 1.0).nonzero().flatten().tolist()) == {5, 17, 40}
    assert set(logits_to_probs(y, 1.0, 2, 1.0).nonzero().flatten().tolist()) == {5, 17}


@pytest.mark.parametrize("top_k", [0, 4, 6])
def test_top_p_walks_equal_logits_by_ascending_id_and_stops_where_the_mass_reaches_p(top_k):
    x = torch.full((256,), float("-inf"))
    x[[200, 31, 77, 5]] = 1.0  # probabilities of exactly 1/4: the walk's sums are exact
    for top_p, kept in [(0.5, {5, 31}), (0.75, {5, 31, 77}), (0.5000001, {5, 31, 77}), (0.2, {5}), (1e-9, {5})]:
        got = logits_to_probs(x, 0.7, top_k, top_p)
        assert set(got.nonzero().flatten().tolist()) == kept, (top_p, top_k)
        assert torch.allclose(got[list(kept)], torch.full((len(kept),), 1.0 / len(kept)))


# -- planted bugs: each disagrees with the engine on the cases above --------------------------------


def _penalty_per_occurrence(logits, prompt, reply, repetition=1.0, frequency=0.0, presence=0.0):
    out = logits.float().clone()
    for tok in list(prompt) + list(reply):  # bug: a repeated id is divided again
        if repetition != 1.0:
            out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    return ref.penalized(out, [], reply, 1.0, frequency, presence)


def _top_p_before_temperature(logits, temperature, top_k=0, top_p=1.0):
    nucleus = ref.probs(logits, 1.0, top_k, top_p)[0] > 0
    return ref.probs(logits.masked_fill(~nucleus, float("-inf")), temperature, top_k, 1.0)


def _top_k_drops_ties(logits, temperature, top_k=0, top_p=1.0):
    x = (logits.float() / temperature if temperature else logits).tolist()
    if 0 < top_k < len(x):
        cut = torch.ones(len(x), dtype=torch.bool)
        cut[sorted(range(len(x)), key=lambda i: (-x[i], i))[:top_k]] = False
        logits = logits.masked_fill(cut, float("-inf"))
    return ref.probs(logits, temperature, 0, top_p)


def _top_p_counts_the_token_itself(logits, temperature, top_k=0, top_p=1.0):
    return ref.probs(logits, temperature, top_k, top_p if top_p >= 1.0 else top_p - 1e-3)


@pytest.mark.parametrize("bug", [dict(penalized=_penalty_per_occurrence), dict(probs=_top_p_before_temperature),
                                 dict(probs=_top_k_drops_ties), dict(probs=_top_p_counts_the_token_itself)],
                         ids=["penalty-per-occurrence", "top-p-before-temperature", "top-k-drops-ties", "top-p-boundary"])
def test_the_comparison_rejects_planted_bugs(bug):
    assert any(not ref.agrees(_engine(c), _reference(c, **bug)[0]) for c in CASES)


# -- the pieces ----------------------------------------------------------------------------------------


def test_blockwise_topk_returns_the_values_of_torch_topk():
    torch.manual_seed(1)
    for x in (torch.randn(3, support.BLOCK * 170), torch.randint(0, 6, (2, support.BLOCK * 170)).float(),
              torch.randn(support.BLOCK * 7 + 5)):
        for n in (1, 41):
            vals, ids = support.topk(x, n)
            assert torch.equal(vals, torch.topk(x, n).values)
            assert torch.equal(x.gather(-1, ids), vals) and ids.unique(dim=-1).shape == ids.shape


def test_draw_follows_the_weights_and_never_draws_a_zero():
    w = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0, 0.0]) * 3  # unnormalised, zeros inside and at both ends
    gen = make_generator(0)
    got = torch.stack([support.draw(w.expand(500, -1), gen) for _ in range(8)]).flatten()
    counts = torch.bincount(got, minlength=7)
    assert counts[w == 0].sum() == 0
    assert chisquare(counts[w > 0].numpy(), (w[w > 0] / w.sum() * got.numel()).numpy()).pvalue > 1e-3
    assert sample(torch.tensor([0.0, 0.0, 1.0]), gen) == 2
