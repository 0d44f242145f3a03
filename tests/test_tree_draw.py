"""The speculator's tree depth (:func:`treedraw.draw_depth`: B rows penalized in place and put back, drawn
on the top-k support, q' kept there) against each row drawn on its own from the distribution written
out plainly (:mod:`reference_sampling`): random logits, histories, per-row prefixes and draws, settings
with ties at the k-th place and exact top-p boundaries, Saguaro reshaping.  q' must be the reference
distribution, each token must be drawn from it (chi-square), and the speculator's tree must hand out
those q' rows for its branches."""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from helpers import reference_sampling as ref
from ssd_chat.engine.sampling import support
from ssd_chat.engine.sampling.penalties import Penalties
from ssd_chat.engine.sampling.sampling import logits_to_probs, make_generator, saguaro_reshape
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.speculate.treedraw import draw_depth

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(rng: random.Random, vocab: int) -> dict:
    torch.manual_seed(rng.randrange(1 << 30))
    rows = rng.randint(1, 8)
    if rng.random() < 0.3:  # few distinct values: ties inside the support and across the k-th place
        logits = torch.randint(-4, 5, (rows, vocab)).float() * 0.5
    else:
        logits = torch.randn(rows, vocab) * rng.choice([0.5, 2.0, 5.0])
    few = rng.sample(range(vocab), 12)
    pick = lambda n: [rng.choice(few) for _ in range(n)]  # noqa: E731
    d = rng.randint(0, 3)
    prompt, reply = pick(rng.randint(0, 10)), pick(rng.randint(0, 10))
    prefixes = [pick(rng.randint(0, 4)) for _ in range(rows)]
    drawn = torch.tensor([pick(d) for _ in range(rows)], dtype=torch.long).reshape(rows, d) if d else None
    temperature, top_k, top_p = rng.choice([0.3, 0.8, 1.0, 1.7]), rng.choice([1, 3, 40, 40, vocab - 1]), rng.choice([1.0, 0.9, 0.5, 0.1])
    saguaro_c = rng.choice([1.0, 1.0, 0.5])
    rep, freq, pres = rng.choice([(1.0, 0.0, 0.0), (1.1, 0.0, 0.0), (1.5, 0.5, 0.4), (0.8, -0.3, 0.0)])
    return dict(
        logits=logits, prompt=prompt, reply=reply, prefixes=prefixes, drawn=drawn, saguaro_c=saguaro_c,
        settings=SamplingParams(temperature, top_p, top_k, 0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres),
        num_top=rng.choice([0, 2, 5]),
    )


def _reference(c: dict) -> tuple[torch.Tensor, float]:
    """Each row alone: its own history penalized token by token, then its distribution over the vocabulary."""
    s, out, margin = c["settings"], [], math.inf
    for r, row in enumerate(c["logits"]):
        own = c["prefixes"][r] + ([] if c["drawn"] is None else c["drawn"][r].tolist())
        x = ref.penalized(row, c["prompt"], c["reply"] + own, s.repetition_penalty, s.frequency_penalty, s.presence_penalty)
        p, m = ref.probs(x, s.temperature, s.top_k, s.top_p)
        out.append(p)
        margin = min(margin, m)
    q = torch.stack(out)
    return (saguaro_reshape(q, c["saguaro_c"], c["num_top"]) if c["num_top"] else q), margin


def _depth(c: dict, seed: int):
    s = c["settings"]
    pen = Penalties(s.repetition_penalty, s.frequency_penalty, s.presence_penalty, c["prompt"], c["reply"])
    before = c["logits"].clone()
    out = draw_depth(c["logits"], pen, c["prefixes"], c["drawn"], s, c["saguaro_c"], make_generator(seed), c["num_top"])
    assert torch.equal(c["logits"], before)  # penalized in place for the draw only: the logits are the tree's
    return out


CASES = ref.cases(80, 5, lambda rng: _case(rng, rng.choice([64, 300, support.BLOCK * 170])), _reference)


def test_a_tree_depth_draws_each_row_from_its_reference_distribution():
    on_support = 0
    for i, c in enumerate(CASES):
        tok, q = _depth(c, i)
        on_support += isinstance(q, support.Support)
        dense = support.as_dense(q)
        want = c["want"]
        assert ref.agrees(dense, want), i
        assert bool((want.gather(-1, tok[:, None]) > 0).all()), i
        assert bool((dense.gather(-1, tok[:, None]) > 0).all()), i
    assert 20 < on_support < len(CASES) - 10  # the support path and the dense fallback (ties) both checked


def test_the_tree_depth_draws_follow_q():
    """Many draws of one depth, every row's tokens against its reference q' (8 rows, penalties, top-p)."""
    c = next(c for c in CASES if c["logits"].shape[0] >= 4 and c["settings"].top_k == 40 and c["settings"].top_p < 1
             and c["settings"].repetition_penalty != 1.0 and c["logits"].shape[1] == 300)
    gen = make_generator(7)
    s = c["settings"]
    pen = Penalties(s.repetition_penalty, s.frequency_penalty, s.presence_penalty, c["prompt"], c["reply"])
    n = 3000
    toks = torch.stack([draw_depth(c["logits"], pen, c["prefixes"], c["drawn"], s, c["saguaro_c"], gen, c["num_top"])[0] for _ in range(n)])
    for r in range(toks.shape[1]):
        want = c["want"][r]
        counts = torch.bincount(toks[:, r], minlength=want.shape[0]).double()
        assert counts[want == 0].sum() == 0
        keep = want > 0
        assert chisquare(counts[keep].numpy(), (want[keep] / want[keep].sum() * n).numpy()).pvalue > 1e-4, r


def test_stacked_depths_give_each_branch_its_own_rows():
    c = next(c for c in CASES if c["logits"].shape[0] >= 3 and c["settings"].top_k == 40)
    qs = [_depth(c, seed)[1] for seed in range(2)]
    both = support.stack(qs, 1)
    for b in range(c["logits"].shape[0]):
        assert torch.equal(support.as_dense(both[b]), torch.stack([support.as_dense(q)[b] for q in qs]))
    mixed = support.stack([qs[0], support.as_dense(qs[1])], 1)  # a depth that fell back to dense
    assert torch.equal(mixed, torch.stack([support.as_dense(q) for q in qs], 1))


def test_the_comparison_rejects_a_planted_batching_bug(monkeypatch):
    """Rows penalized for the first row's prefix (a batching slip) disagree with the reference."""
    real = Penalties._penalize

    def first_rows_prefix(self, flat, prefixes, drawn, drawn_valid):
        return real(self, flat, [prefixes[0]] * len(prefixes) if prefixes else prefixes, drawn, drawn_valid)

    monkeypatch.setattr(Penalties, "_penalize", first_rows_prefix)
    bad = 0
    for i, c in enumerate(CASES):
        q = support.as_dense(_depth(c, i)[1])
        bad += not (torch.equal(q > 0, c["want"] > 0) and torch.allclose(q.double(), c["want"], atol=1e-6, rtol=1e-4))
    assert bad > 5


def test_equal_logits_inside_the_support_are_walked_by_ascending_id():
    """Rows whose top-k holds equal logits, with top-p cutting through them: which ids stay is decided
    by the id order alone (the support path must not keep topk's unordered ties)."""
    v = support.BLOCK * 170
    x = (-9.0 - 1e-3 * torch.arange(v)).repeat(3, 1)  # below them, distinct: no tie at the k-th place
    x[0, [200, 31, 7000, 5]] = 1.0  # four of probability about 1/4: top-p 0.5 keeps 5 and 31
    x[1, [900, 12, 20000]] = 2.0
    x[1, [3, 15000]] = 1.0
    x[2, [77, 8]] = 0.5
    for top_p in (0.5, 0.75, 0.3):
        c = dict(logits=x, prompt=[], reply=[], prefixes=[[], [], []], drawn=None, num_top=0,
                 settings=SamplingParams(0.7, top_p, 6, 0), saguaro_c=1.0)
        want, _ = _reference(c)
        tok, q = _depth(c, 0)
        assert isinstance(q, support.Support)
        assert torch.equal(support.as_dense(q) > 0, want > 0), top_p
        assert torch.allclose(support.as_dense(q).double(), want, atol=1e-6), top_p
