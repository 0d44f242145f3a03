"""Fan-out policies for the SSD speculation cache: how many bonus-token guesses to cache
for each possible accepted length j = 0..k.

Notation as in Kumar, Dao & May (2026): ``F_j`` is the fan-out at accepted length j,
``B = sum(F_j)`` the cache budget.  One list is used after a hit (``F^p``) and one after a miss
(``F^b``): the paper lets them differ because the acceptance rates differ.

Policies (``--fan-out``): ``uniform:F`` (F_j = F); ``geometric``, Saguaro's capped geometric series
under budget B (Theorem 12): ``F_j ∝ a^(j/(1+r))`` for j < k and ``F_k ∝ a^(k/(1+r)) * (1-a)^(-1/(1+r))``,
with the per-token acceptance rate ``a`` estimated online (after hits and after misses apart) and
rounded to integers that sum to B; or explicit lists of k + 1 numbers (``3,3,2,2,1``, or
``4,3,2,2,1/2,2,2,2,2`` after a hit / after a miss).
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field

from .errors import ParamError

DEFAULT_FAN_OUT = "geometric"
R_EXPONENT = 1.0  # power-law exponent r of the miss rate 1 - p_hit(F) = F^-r  [I: not estimated online]
A_PRIOR = 0.7  # prior per-token acceptance before any round has been seen  [I]
A_PRIOR_WEIGHT = 4.0  # the prior counts as this many drafted tokens
A_WINDOW = 32  # rounds remembered per list
A_CLAMP = (0.05, 0.95)  # keeps (1 - a)^(-1/(1+r)) finite

# How wide the speculation tree may be.  Each round drafts k tokens for each of B branches, and keeps
# per branch and depth the draft's logits and its proposal q' (V floats each): B * k * V * 8 bytes at
# most, plus the KV of k * B more positions and a B x (context + k * B) attention mask per step.
MAX_BUDGET = 256  # over ten times the SSD reference's tree (F=3, k=6: B=21); wider only multiplies draft work
TREE_BYTES = 2 << 30  # logits and q' rows of one tree (next to the models); caps B at TREE_BYTES / (k * V * 8)
BYTES_PER_ROW_ENTRY = 8  # a float32 logit and a float32 probability per branch, depth and token


def default_budget(k: int) -> int:
    """B when --budget is not given.  Measured on SmolLM2-135M with 2 CPU cores (README, "SSD"):
    a tree forward over B tokens costs about the same as one over 1 token up to B ~ 8, and the
    hit rate under greedy decoding saturates there."""
    return 2 * (k + 1)


def max_budget(k: int, vocab_size: int | None = None) -> int:
    """The widest tree allowed: :data:`MAX_BUDGET`, and with a known vocabulary within :data:`TREE_BYTES`."""
    if not vocab_size:
        return MAX_BUDGET
    return max(1, min(MAX_BUDGET, TREE_BYTES // (k * vocab_size * BYTES_PER_ROW_ENTRY)))


def check_budget(budget: int, k: int, vocab_size: int | None = None, what: str = "budget") -> None:
    """ParamError (saying the bound) unless ``budget`` outcomes of k tokens fit :func:`max_budget`."""
    if budget > MAX_BUDGET:
        raise ParamError(f"{what} B={budget} is more than ssd-chat caches per round (at most {MAX_BUDGET})")
    most = max_budget(k, vocab_size)
    if budget > most:
        need = budget * k * (vocab_size or 0) * BYTES_PER_ROW_ENTRY
        raise ParamError(
            f"{what} B={budget} with k={k} over a {vocab_size}-token vocabulary needs {need / 2**30:.1f} GiB of draft "
            f"distributions per round (B x k x vocabulary x {BYTES_PER_ROW_ENTRY} bytes), over the {TREE_BYTES / 2**30:.0f} GiB "
            f"limit: use a budget of at most {most}, or a smaller k")


def geometric(k: int, budget: int, a: float, r: float = R_EXPONENT, cap: int | None = None) -> list[int]:
    """Theorem 12's fan-out for acceptance rate ``a``: k + 1 non-negative integers summing to ``budget``
    (each at most ``cap``, e.g. the number of candidate tokens)."""
    a = min(max(a, A_CLAMP[0]), A_CLAMP[1])
    w = [a ** (j / (1 + r)) for j in range(k)] + [a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r))]
    return _round_to_budget(w, budget, cap)


def _round_to_budget(weights: list[float], budget: int, cap: int | None) -> list[int]:
    """Integers proportional to ``weights`` summing to ``budget`` (largest remainder; ties to lower j),
    each <= cap; whatever the caps refuse goes to the others."""
    n = len(weights)
    cap = budget if cap is None else cap
    budget = min(budget, cap * n)
    total = sum(weights)
    exact = [budget * w / total for w in weights]
    out = [min(cap, math.floor(x)) for x in exact]
    while sum(out) < budget:  # hand out the rest, largest shortfall first
        j = min((j for j in range(n) if out[j] < cap), key=lambda j: (-(exact[j] - out[j]), j))
        out[j] += 1
    return out


@dataclass
class AcceptanceEstimate:
    """Per-token acceptance a from the last rounds: accepted / (accepted + rejections)."""

    k: int
    rounds: deque = field(default_factory=lambda: deque(maxlen=A_WINDOW))

    def observe(self, accepted: int) -> None:
        self.rounds.append(accepted)

    @property
    def value(self) -> float:
        acc = sum(self.rounds)
        trials = acc + sum(1 for n in self.rounds if n < self.k)
        return (acc + A_PRIOR * A_PRIOR_WEIGHT) / (trials + A_PRIOR_WEIGHT)


@dataclass
class FanOut:
    """A parsed ``--fan-out``: gives the hit and miss lists for the current round."""

    k: int
    kind: str  # "uniform" | "geometric" | "list"
    budget: int
    fixed_hit: tuple[int, ...] | None = None
    fixed_miss: tuple[int, ...] | None = None
    cap: int | None = None  # at most this many candidates per position (vocabulary size - 1)
    after_hit: AcceptanceEstimate = field(init=False)
    after_miss: AcceptanceEstimate = field(init=False)

    def __post_init__(self) -> None:
        self.after_hit = AcceptanceEstimate(self.k)
        self.after_miss = AcceptanceEstimate(self.k)

    def observe(self, accepted: int, was_hit: bool) -> None:
        """Record a verification outcome (``accepted`` of k) of a round whose drafts were a hit or a miss."""
        (self.after_hit if was_hit else self.after_miss).observe(accepted)

    def lists(self) -> tuple[list[int], list[int]]:
        """(F^p, F^b): the fan-out to use when the current speculation was a hit / a miss."""
        if self.kind == "geometric":
            return (geometric(self.k, self.budget, self.after_hit.value, cap=self.cap),
                    geometric(self.k, self.budget, self.after_miss.value, cap=self.cap))
        hit, miss = list(self.fixed_hit or ()), list(self.fixed_miss or ())
        if self.cap is not None:
            hit, miss = [min(f, self.cap) for f in hit], [min(f, self.cap) for f in miss]
        return hit, miss


def parse(spec: str | None, k: int, budget: int | None = None, vocab_size: int | None = None) -> FanOut:
    """Parse ``--fan-out`` (None: the default) with ``--budget`` (None: :func:`default_budget`).
    Raises ParamError with a one-line message on bad input."""
    cap = vocab_size - 1 if vocab_size else None
    if budget is not None and budget < 1:
        raise ParamError(f"budget must be at least 1, got {budget}")
    s = (spec or DEFAULT_FAN_OUT).strip().lower().replace(" ", "")
    if s == "geometric":
        # the default shrinks to fit a large vocabulary at a large k; a budget the user chose is checked
        budget = budget if budget is not None else min(default_budget(k), max_budget(k, vocab_size))
        check_budget(budget, k, vocab_size)
        return FanOut(k, "geometric", budget, cap=cap)
    m = re.fullmatch(r"uniform:(\d+)", s)
    if m:
        f = int(m.group(1))
        if f < 1:
            raise ParamError(f"fan-out uniform:F needs F >= 1, got {f}")
        if budget is not None and budget != f * (k + 1):
            raise ParamError(f"fan-out uniform:{f} with k={k} caches {f * (k + 1)} outcomes, but --budget is {budget}; drop one of them")
        check_budget(f * (k + 1), k, vocab_size, f"fan-out uniform:{f} with k={k} caches F x (k+1) outcomes; its budget")
        lst = (f,) * (k + 1)
        return FanOut(k, "uniform", f * (k + 1), lst, lst, cap)
    if re.fullmatch(r"[\d,]+(/[\d,]+)?", s):
        parts = s.split("/")
        lists = []
        for p in parts:
            try:
                lst = tuple(int(x) for x in p.split(","))
            except ValueError:
                raise ParamError(f"bad fan-out list '{p}': use comma-separated integers like 3,3,2,2,1") from None
            if len(lst) != k + 1:
                raise ParamError(f"fan-out list '{p}' has {len(lst)} entries but k={k} needs k+1 = {k + 1} (one per accepted length 0..k)")
            if sum(lst) < 1:
                raise ParamError(f"fan-out list '{p}' caches nothing; give at least one positive entry")
            lists.append(lst)
        hit, miss = lists[0], lists[-1]
        if budget is not None and budget != sum(hit):
            raise ParamError(f"fan-out list sums to {sum(hit)}, but --budget is {budget}; drop one of them")
        check_budget(max(sum(hit), sum(miss)), k, vocab_size, "the fan-out list's sum")
        return FanOut(k, "list", sum(hit), hit, miss, cap)
    raise ParamError(f"unknown fan-out '{spec}' (use uniform:F, geometric, or a list like 3,3,2,2,1 with k+1 entries)")
