"""Distribution tests for sampling decoders (SD, SSD): is the output distributed exactly as the target's?

Two halves:

* :func:`exact_distribution` enumerates every possible start of a reply on a tiny,
  small-vocabulary target and returns the exact probability of each, under the same
  temperature / top-k / top-p transform written out plainly (:mod:`reference_sampling`), not the
  engine's code.
* :func:`sample_outcomes` runs a decoder many times with seeds ``seed0, seed0+1, ...``
  and counts the replies it produced; :func:`compare` turns counts plus the exact
  distribution into a chi-square p-value and the total-variation distance.

An *outcome* is ``Done.token_ids`` of a reply limited to ``max_new_tokens = n``: a
tuple of n ids, or fewer when the reply ended with EOS (EOS itself is not in
``token_ids``).  Usage::

    exact = exact_distribution(target, prompt, n=3, params=params)
    counts = sample_outcomes(decoder.stream, prompt, params, n=3, num_samples=3000)
    result = compare(counts, exact)
    assert result.p_value > 1e-3, result
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ssd_chat.engine.events import Done, Error, Event
from ssd_chat.engine.load.models import LoadedModel
from ssd_chat.engine.params import SamplingParams
from helpers.reference_sampling import probs as reference_probs

Outcome = tuple[int, ...]
StreamFn = Callable[[list[int], SamplingParams], Iterable[Event]]


@torch.inference_mode()
def exact_distribution(target: LoadedModel, prompt_ids: list[int], n: int, params: SamplingParams) -> dict[Outcome, float]:
    """P(first ``n`` reply tokens) for ``target`` under ``params`` (temperature, top-k, top-p, EOS).

    Breadth-first over prefixes; each depth is one batched forward of every live
    prefix (no KV cache, so nothing here shares code paths with the decoders).
    """
    model, dev = target.model, target.device
    eos = frozenset() if params.ignore_eos else target.eos_ids
    done: dict[Outcome, float] = {}
    live: dict[Outcome, float] = {(): 1.0}
    for depth in range(n):
        prefixes = list(live)
        ids = torch.tensor([list(prompt_ids) + list(pre) for pre in prefixes], device=dev)  # [B, L + depth]
        logits = model(input_ids=ids).logits[:, -1].double()  # [B, V]
        logits = torch.stack([_penalized(row, prompt_ids, pre, params) for row, pre in zip(logits, prefixes)])
        probs = torch.stack([reference_probs(row, params.temperature, params.top_k, params.top_p)[0] for row in logits])  # [B, V]
        nxt: dict[Outcome, float] = {}
        for pre, row in zip(prefixes, probs):
            for tok in row.nonzero().flatten().tolist():
                pr = live[pre] * float(row[tok])
                if tok in eos:
                    done[pre] = done.get(pre, 0.0) + pr
                elif depth == n - 1:
                    done[pre + (tok,)] = pr
                else:
                    nxt[pre + (tok,)] = pr
        live = nxt
    return done


def _penalized(logits: torch.Tensor, prompt_ids: list[int], reply: Outcome, params: SamplingParams) -> torch.Tensor:
    """The penalties written out token by token (vLLM's formulas), independently of the engine's code:
    repetition over prompt + reply (CTRL), frequency and presence over the reply (OpenAI)."""
    out = logits.clone()
    for tok in set(prompt_ids) | set(reply):
        if params.repetition_penalty != 1.0:
            x = float(out[tok])
            out[tok] = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
    for tok in set(reply):
        out[tok] -= params.frequency_penalty * reply.count(tok) + params.presence_penalty
    return out


def sample_outcomes(
    stream: StreamFn, prompt_ids: list[int], params: SamplingParams, n: int, num_samples: int, seed0: int = 0
) -> Counter[Outcome]:
    """Run ``stream(prompt_ids, params)`` ``num_samples`` times (seed ``seed0 + i``, ``max_new_tokens = n``)
    and count the replies (``Done.token_ids``).  A run that errors or never finishes raises.

    Runs with one torch thread: for tiny models, thread hand-offs cost more than the math
    (20x slower with 2 threads on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sample_outcomes(stream, prompt_ids, params, n, num_samples, seed0)
    finally:
        torch.set_num_threads(threads)


def _sample_outcomes(stream: StreamFn, prompt_ids: list[int], params: SamplingParams, n: int, num_samples: int, seed0: int) -> Counter[Outcome]:
    counts: Counter[Outcome] = Counter()
    for i in range(num_samples):
        p = dataclasses.replace(params, seed=seed0 + i, max_new_tokens=n)
        last = None
        for ev in stream(list(prompt_ids), p):
            if isinstance(ev, Error):
                raise AssertionError(f"sample {i}: the decoder failed: {ev.message}")
            last = ev
        if not isinstance(last, Done):
            raise AssertionError(f"sample {i}: the stream ended without a Done event (last: {last!r})")
        counts[tuple(last.token_ids)] += 1
    return counts


@dataclass(frozen=True)
class Comparison:
    p_value: float  # chi-square goodness of fit (0.0 if an impossible outcome was seen)
    tv: float  # total-variation distance between the empirical and the exact distribution
    num_samples: int
    num_bins: int  # chi-square bins after pooling rare outcomes
    impossible: tuple[Outcome, ...]  # outcomes seen that have exact probability 0

    def __str__(self) -> str:
        extra = f", impossible outcomes seen: {list(self.impossible)[:5]}" if self.impossible else ""
        return f"chi-square p={self.p_value:.3g}, TV={self.tv:.4f} over {self.num_samples} samples in {self.num_bins} bins{extra}"


def compare(counts: Counter[Outcome], exact: dict[Outcome, float], min_expected: float = 5.0,
            key: Callable[[Outcome], Any] | None = None) -> Comparison:
    """Chi-square goodness of fit of ``counts`` against ``exact``.

    Outcomes whose expected count is below ``min_expected`` are pooled into one bin
    (the usual validity condition of the chi-square approximation).  ``key`` tests a statistic of
    the outcomes instead (e.g. which neighbouring tokens are equal): its exact distribution follows
    from ``exact``, and a few coarse bins find a small, targeted deviation with far fewer samples.
    """
    from scipy.stats import chisquare

    if key is not None:
        counts, exact = _project(counts, key), _project(exact, key)  # type: ignore[assignment]

    total = sum(counts.values())
    if total == 0:
        raise ValueError("no samples")
    mass = sum(exact.values())
    if abs(mass - 1.0) > 1e-4:
        raise ValueError(f"the exact distribution sums to {mass}, not 1")
    exact = {o: pr / mass for o, pr in exact.items()}  # float32 probabilities: renormalise the last ulps
    impossible = tuple(o for o in counts if exact.get(o, 0.0) <= 0.0)
    support = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(o, 0) / total - exact.get(o, 0.0)) for o in support)
    big = [o for o in exact if exact[o] * total >= min_expected]
    small = [o for o in exact if exact[o] * total < min_expected]
    obs = [counts.get(o, 0) for o in big]
    exp = [exact[o] * total for o in big]
    if small:
        obs.append(sum(counts.get(o, 0) for o in small))
        exp.append(sum(exact[o] for o in small) * total)
    if impossible:  # an outcome the target can never produce: no test statistic needed
        return Comparison(0.0, tv, total, len(obs), impossible)
    if len(obs) < 2:
        return Comparison(1.0, tv, total, len(obs), impossible)
    p = float(chisquare(obs, exp).pvalue)
    return Comparison(p, tv, total, len(obs), impossible)


def _project(dist: Any, key: Callable[[Outcome], Any]) -> Any:
    out: dict[Any, Any] = {}
    for o, v in dist.items():
        out[key(o)] = out.get(key(o), 0) + v
    return Counter(out) if isinstance(dist, Counter) else out


def decoder_distribution_test(
    stream: StreamFn,
    target: LoadedModel,
    prompt_ids: list[int],
    params: SamplingParams,
    n: int = 3,
    num_samples: int = 3000,
    seed0: int = 0,
) -> Comparison:
    """Everything in one call: exact distribution, ``num_samples`` runs, comparison."""
    exact = exact_distribution(target, prompt_ids, n, params)
    counts = sample_outcomes(stream, prompt_ids, params, n, num_samples, seed0)
    return compare(counts, exact)
