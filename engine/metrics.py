"""Running statistics from the event stream (names as vLLM / SGLang / the SSD paper use them).

* mean accepted length (tau) = 1 + accepted draft tokens / verifications (bonus included)
* acceptance rate = accepted draft tokens / drafted tokens
* chained acceptance = accepted / (accepted + rejections): the chance a draft token is accepted
  when the ones before it were (the per-token rate ``a`` of the SSD paper and ``fanout``)
* per-position acceptance[i] = P(draft position i accepted) over all rounds that drafted it
* cache-hit rate = hits / verifications (SSD)
* decode tok/s = (n - n_first) / (t_last_token - t_first_token), n_first the tokens that came with the first
  (1 in AR, the first round's in SD/SSD); TTFT = t_first_token

Two physical bounds on a speedup, one rule each for the bench, ``compare``, Ctrl+G and the panel:
SSD/SD <= 1 + SD's draft time / SD's verify time over the same rounds (with the same draft and
accepted lengths, SSD can at most hide SD's drafting), and SD/AR, SSD/AR <= mean accepted length
(a round emits that many tokens per target forward, and a k+1-row forward costs at least AR's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import Event, Notice, Round, Stats, Token, mode_label


def ssd_over_sd_bound(sd_draft_s: float | None, sd_verify_s: float | None) -> float | None:
    """The most SSD can gain over SD: 1 + draft / verify of SD (per round, or totals over the same rounds)."""
    if sd_draft_s is None or not sd_verify_s or sd_verify_s <= 0:
        return None
    return 1 + max(0.0, sd_draft_s) / sd_verify_s


def over_ar_bound(mean_accepted_length: float | None) -> float | None:
    """The most SD or SSD can gain over AR: its mean accepted length (tokens per target forward)."""
    return mean_accepted_length


@dataclass(slots=True)
class Metrics:
    mode: str
    prefill_s: float = 0.0
    num_tokens: int = 0
    t_first: float | None = None
    t_last: float | None = None
    n_first: int = 0  # tokens that came at t_first
    num_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_rejected: int = 0  # rounds that rejected a draft token
    position_drafted: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    num_hits: int = 0
    num_ssd_rounds: int = 0
    accepted_on_hit: int = 0
    accepted_on_miss: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    wait_s: float = 0.0
    has_wait: bool = False
    sd_estimate_s: float | None = None
    ran_as: str | None = None  # the mode the reply switched to (see Notice.mode)
    switched_after: int | None = None
    path: str | None = None  # "compiled" or "eager": what the target ran on (forward.Forwards.path)

    def add(self, ev: Event) -> None:
        if isinstance(ev, Token):
            self.num_tokens += 1
            if self.t_first is None:
                self.t_first = ev.t_s
            if ev.t_s == self.t_first:  # the first block (SD/SSD's first round) is prefill's, not decoding's
                self.n_first += 1
            self.t_last = ev.t_s
        elif isinstance(ev, Round):
            self._add_round(ev)
        elif isinstance(ev, Notice) and ev.mode is not None:
            if self.ran_as is None:
                self.switched_after = ev.after_round
            self.ran_as = ev.mode

    @property
    def label(self) -> str:
        return mode_label(self.mode, self.ran_as, self.switched_after)

    @property
    def chained_acceptance(self) -> float | None:
        trials = self.num_accepted + self.num_rejected
        return self.num_accepted / trials if trials else None

    def _add_round(self, r: Round) -> None:
        self.num_rounds += 1
        k = len(r.drafted)
        self.num_drafted += k
        self.num_accepted += r.accepted
        self.num_rejected += r.accepted < k
        while len(self.position_drafted) < k:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(k):
            self.position_drafted[i] += 1
            if i < r.accepted:
                self.position_accepted[i] += 1
        self.draft_s += r.draft_s
        self.verify_s += r.verify_s
        if r.wait_s is not None:
            self.wait_s += r.wait_s
            self.has_wait = True
        if r.cache_hit is not None:
            self.num_ssd_rounds += 1
            if r.cache_hit:
                self.num_hits += 1
                self.accepted_on_hit += r.accepted
            else:
                self.accepted_on_miss += r.accepted

    def stats(self, elapsed_s: float) -> Stats:
        n = self.num_tokens
        tok_per_s = None
        if n > self.n_first and self.t_last is not None and self.t_first is not None and self.t_last > self.t_first:
            tok_per_s = (n - self.n_first) / (self.t_last - self.t_first)  # None when one block was the whole reply
        spec = self.num_rounds > 0
        hits, misses = self.num_hits, self.num_ssd_rounds - self.num_hits
        return Stats(
            mode=self.mode,
            new_tokens=n,
            rounds=self.num_rounds,
            elapsed_s=elapsed_s,
            prefill_s=self.prefill_s,
            ttft_s=self.t_first,
            tok_per_s=tok_per_s,
            acceptance_rate=(self.num_accepted / self.num_drafted) if self.num_drafted else None,
            mean_accepted_length=(1 + self.num_accepted / self.num_rounds) if spec else None,
            cache_hit_rate=(hits / self.num_ssd_rounds) if self.num_ssd_rounds else None,
            per_position_acceptance=tuple(a / d for a, d in zip(self.position_accepted, self.position_drafted)) if spec else None,
            accepted_length_on_hit=(1 + self.accepted_on_hit / hits) if hits else None,
            accepted_length_on_miss=(1 + self.accepted_on_miss / misses) if misses else None,
            draft_s=self.draft_s if spec else None,
            verify_s=self.verify_s if spec else None,
            wait_s=self.wait_s if self.has_wait else None,
            sd_estimate_s=self.sd_estimate_s,
            ran_as=self.ran_as,
            switched_after=self.switched_after,
            path=self.path,
        )
