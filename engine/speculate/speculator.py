"""The SSD speculator: the draft model's side of speculative speculative decoding.

:class:`Speculator` is the algorithm (Kumar, Dao & May 2026, Algorithm 1 and the reference code's
draft runner, spec §2.2): for every round it

1. **serves** the verifier's request for outcome ``(k_prev, bonus)``: from the speculation cache on
   a hit, else from a fallback (neural: k draft steps on the spot; fast: n-gram lookup tokens that
   cost no draft forward), and then
2. **builds** the cache for the round being verified meanwhile: one *glue* forward over
   ``[bonus, d_1..d_k]`` gives the draft's distribution ``g_j`` after each possible accepted length
   j; the candidate bonus tokens for j are the top-F_j of ``g_j`` excluding ``d_{j+1}``; all B
   branches are drafted k tokens deep as one tree, one forward per depth, in the runner's scratch
   rows with a tree mask, so the shared prefix KV is never copied; on a hit the winning branch is
   adopted, not recomputed.

Every draft token is sampled from the distribution q' that is sent with it: the draft's
temperature/top-k/top-p distribution, reshaped by Saguaro sampling (``--saguaro-c``) over the top
``F_j + 1`` tokens [I: the candidates at position j are the top F_j *excluding the sampled token*,
so the top F_j + 1 is the smallest set that holds every token that can become a cached bonus; the
reference code does the same, spec §5.3].  Fast-fallback tokens are point masses (q' = one-hot),
so the verifier's acceptance test stays exact for every proposal.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..sampling.host import read
from ..sampling.penalties import Penalties
from ..sampling.sampling import draw_draft, make_generator
from ..sampling.support import Support, as_dense, stack
from ..drafts.drafter import fit_vocab
from ..model.forward import Forwards
from .channel import Begin, Speculation
from ..fanout import FanOut
from .ngram import NGRAM_WINDOW, common_prefix as _common_prefix, ngram_next as _ngram_next
from .treedraw import draw_depth

Entry = tuple[tuple[int, ...], torch.Tensor | Support | None]  # (k tokens, q' rows [k, V] or on their support, None: point masses)


@dataclass
class _FallbackStats:
    """What each fallback delivers, for ``--fallback auto``: tokens per round of neural drafts
    (rounds drafted by the draft model: hits and neural fallbacks) and of the fast backup,
    *counterfactually*: each round the fast proposal for that round's start is compared with the
    tokens the target then committed; the length of the common prefix is distributed exactly as the
    number of point-mass proposals the verifier would have accepted, so no round is spent exploring."""

    neural: deque = field(default_factory=lambda: deque(maxlen=32))
    fast: deque = field(default_factory=lambda: deque(maxlen=32))
    verify_s: deque = field(default_factory=lambda: deque(maxlen=16))
    proposal: tuple[int, ...] | None = None  # the fast proposal for the round being verified


@dataclass
class _Scratch:
    """Where the last tree's rows are in the runner's scratch region: branch b at depth d is slot
    ``base + d * width + b``; ``depth_logits[d][b]`` its logits."""

    base: int
    width: int
    index: dict[tuple[int, int], int]  # (j, candidate) -> branch
    depth_logits: list[torch.Tensor]


class Speculator:
    """The draft side of SSD for one model on one device (see the module docstring)."""

    def __init__(self, forwards: Forwards, k: int, fan_out: FanOut | None, fallback: str = "neural",
                 vocab: int | None = None, compile: str = "off") -> None:
        self.vocab = vocab  # the target's logits width; draft logits are padded (-inf) or cut to it
        # compiled shapes: a step, the glue (k+1 rows), a tree depth (at most B rows)
        rows = (1, k + 1, fan_out.budget) if fan_out is not None else (1, k + 1)
        self.forwards = forwards
        self.runner = forwards.runner("draft", compile, rows)
        self.device = self.runner.device
        self.k = k
        self.fan = fan_out  # None: no cache (every round a neural fallback)
        self.fallback = fallback
        self.kv_ids: list[int] = []  # the tokens the runner has committed
        self.step_times: deque = deque(maxlen=64)
        self.fb_stats = _FallbackStats()
        self.pen = Penalties()  # per reply, from begin()
        self._reset()

    def _reset(self) -> None:
        self.ctx: list[int] = []  # committed tokens (the draft KV is valid for them after a sync)
        self.pending: int | None = None  # the bonus token of the last outcome (no KV yet)
        self.spec: tuple[int, ...] | None = None  # the speculation being verified now
        self.spec_hit = False
        self.spec_fallback: str | None = None
        self.tree: dict[tuple[int, int], Entry] = {}
        self._cands: tuple[list[int], torch.Tensor | None, list[int] | None] = ([], None, [])  # the tree's js, candidates, read
        self.predicted: tuple[tuple[int, tuple[int, ...]], ...] = ()
        self.build_s = 0.0
        self._glue_logits: list[torch.Tensor] | None = None  # g_0..g_{k-1} left by a neural fallback or a hit
        self._scratch: _Scratch | None = None  # the last complete tree, for _adopt
        self._later: tuple | None = None  # a hit's outcome and branch, taken in after the reply (_settle)

    # -- per reply ------------------------------------------------------------------------
    def begin(self, msg: Begin) -> None:
        """A new reply: prefill the prompt (reusing the KV of a common prefix with the last reply)."""
        self._reset()
        self.params, self.saguaro_c = msg.params, msg.saguaro_c
        self.gen = make_generator(None if msg.params.seed is None else msg.params.seed * 2 + 1, self.device)
        self.ctx = list(msg.prompt_ids)
        n = len(self.ctx) if msg.prompt_len is None else msg.prompt_len
        self.pen = Penalties.of(msg.params, self.ctx[:n], self.ctx[n:])  # counts the reply's tokens in ctx
        self._extend(self.ctx, logits_from=len(self.ctx))
        if not self.step_times and self.ctx:  # a timed decode step, for the SD estimate and --fallback auto
            n = self.runner.length
            for timed in (False, True):  # the first call pays for compiling and first-touch, SD's steps do not
                t0 = time.perf_counter()
                self._forward(self.ctx[-1:])
                if timed:
                    self.step_times.append(time.perf_counter() - t0)
                self.runner.truncate(n)
                del self.kv_ids[n:]

    @property
    def step_s(self) -> float:
        """The median warm draft step (a stall on a loaded machine does not become every round's cost)."""
        return statistics.median(self.step_times) if self.step_times else 0.0

    # -- serving a request ----------------------------------------------------------------
    def serve(self, req: int, k_prev: int, bonus: int, verify_s: float = 0.0) -> tuple[Speculation, torch.Tensor | None]:
        """The speculation for the round after outcome ``(k_prev, bonus)`` (k_prev = -1: the first round).
        Returns the reply and q' rows [k, V] (None: point masses)."""
        self._settle()
        predicted, build_s = self.predicted, self.build_s
        entry = self.tree.get((k_prev, bonus)) if k_prev >= 0 else None
        self.tree, self.predicted = {}, ()  # the cache holds one round only
        last = (self.spec, self.spec_hit, self.spec_fallback)
        if entry is not None:  # a hit: the reply goes out first, the bookkeeping after it (:meth:`_settle`)
            tokens, q = entry[0], (None if entry[1] is None else as_dense(entry[1]))
            self._later = (k_prev, bonus, verify_s, last, tokens)
            self.spec, self.spec_hit, self.spec_fallback = tokens, True, None
            return Speculation(req, tokens, q is not None, True, None, 0.0, predicted, build_s, self.step_s), q
        self._commit(k_prev, bonus, verify_s, *last)
        self._scratch = None
        kind = self._choose_fallback()
        t0 = time.perf_counter()
        tokens, q = self._neural() if kind == "neural" else self._fast()
        fb_s = time.perf_counter() - t0
        self.spec, self.spec_hit, self.spec_fallback = tokens, False, kind
        return Speculation(req, tokens, q is not None, False, kind, fb_s, predicted, build_s, self.step_s), q

    def _commit(self, k_prev: int, bonus: int, verify_s: float, spec: tuple[int, ...] | None, spec_hit: bool,
                spec_fallback: str | None) -> None:
        """Take in the outcome (k_prev, bonus) of the round that ``spec`` was verified in."""
        if spec is not None and k_prev >= 0:
            self.ctx += [self.pending] + list(spec[:k_prev])  # type: ignore[list-item]
            self.pen.add([self.pending, *spec[:k_prev]])  # type: ignore[list-item]
            if self.fan is not None:
                self.fan.observe(k_prev, spec_hit)
            st = self.fb_stats
            if spec_fallback != "fast":
                st.neural.append(1 + k_prev)
            if st.proposal is not None:
                st.fast.append(1 + _common_prefix(st.proposal, [*spec[:k_prev], bonus]))
            if verify_s > 0:
                st.verify_s.append(verify_s)
        self.fb_stats.proposal = None
        self.pending = bonus

    def _choose_fallback(self) -> str:
        """neural | fast.  ``auto`` compares expected tokens per second (Theorem 7's miss terms):
        ``E_neural / (T_round + k * T_step)`` against ``E_fast / T_round``, with E from the last
        rounds (:class:`_FallbackStats`), T_round = max(verify, cache build) and T_step the
        measured draft step; neural until 4 rounds have been seen  [I]."""
        if self.fallback != "auto":
            return self.fallback
        st = self.fb_stats
        if len(st.neural) < 4 or len(st.fast) < 4 or not st.verify_s or not self.step_times:
            return "neural"
        t_round = max(sum(st.verify_s) / len(st.verify_s), self.build_s)
        e_n, e_f = sum(st.neural) / len(st.neural), sum(st.fast) / len(st.fast)
        rate_n = e_n / (t_round + self.k * self.step_s)
        rate_f = e_f / max(t_round, 1e-9)
        return "neural" if rate_n >= rate_f else "fast"

    def _neural(self) -> Entry:
        """k draft steps from ``ctx + [pending]`` (what SD does; spec §2.6 JIT backup): each drawn token
        is fed back on the device, and the k tokens are read once, at the end."""
        hit_list, miss_list = self._lists()
        ids = self.ctx + [self.pending]  # type: ignore[list-item]
        g = [self._extend(ids, logits_from=len(ids) - 1)[-1]]
        drawn: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        t0 = time.perf_counter()
        for i in range(self.k):
            logits = g[-1][None]
            if self.pen.active:  # penalized for the bonus and this request's draws so far
                logits = self.pen.apply(logits, [[self.pending]], torch.cat(drawn).reshape(1, -1) if drawn else None)  # type: ignore[list-item]
            x, q = self._draw(logits, miss_list[i] if miss_list else 0)  # [1], [1, V]
            drawn.append(x)
            if q is not None:
                qs.append(q[0])
            if i < self.k - 1:
                g.append(fit_vocab(self.runner.append(x).logits, self.vocab)[-1])
        tokens = tuple(read(torch.cat(drawn), "neural drafts"))  # the request's one read
        self.step_times.append((time.perf_counter() - t0) / self.k)  # a step and its draw, synced by the read
        self.kv_ids.extend(tokens[:-1])
        self._glue_logits = g  # valid while kv_ids == ctx + [pending] + tokens[:-1]
        return tokens, (torch.stack(qs) if qs else None)

    def _fast(self) -> Entry:
        """k tokens by n-gram lookup in the context (prompt lookup decoding): no draft forward.
        Point-mass proposals (q' = one-hot), so the verifier accepts each with probability p(token)."""
        hist = (self.ctx + [self.pending])[-NGRAM_WINDOW:]  # type: ignore[list-item]
        out: list[int] = []
        for _ in range(self.k):
            out.append(_ngram_next(hist + out))
        return tuple(out), None

    # -- building the cache -----------------------------------------------------------------
    @torch.inference_mode()
    def build(self, abort: Callable[[], bool] = lambda: False) -> None:
        """Predict the outcomes of the round being verified and draft k tokens for each (one tree)."""
        self._settle()
        self._scratch = None  # a miss or a new reply: the last tree is of no use
        if self.spec is None or self.fan is None:
            return
        t0 = time.perf_counter()
        k, spec = self.k, list(self.spec)
        L = len(self.ctx)
        ids = self.ctx + [self.pending] + spec  # type: ignore[list-item]
        # glue: the draft's distributions g_0..g_k after [bonus, d_1..d_j]
        if self._glue_logits is not None and self.kv_ids == ids[:-1]:
            g = torch.stack(self._glue_logits + [self._forward(spec[-1:])[-1]])  # [k+1, V]
        else:
            g = self._extend(ids, logits_from=L)  # [k+1, V]
        self._glue_logits = None
        hit_list, miss_list = self._lists()
        fan = hit_list if self.spec_hit else miss_list
        # candidate bonus tokens: top-F_j of g_j, never the token drafted there
        rows = self.pen.rows(g.float(), [self.pending, *spec], 1).clone()  # type: ignore[list-item]  # row j: after [bonus, d_1..d_j]
        V = rows.shape[-1]
        rows[torch.arange(k), torch.tensor(spec, device=rows.device)] = float("-inf")
        top = torch.topk(rows, min(max(fan), V)).indices  # [k+1, F]: one top-F over every row, sliced per j
        # how many candidates each j gets is known here; which tokens they are stays on the device
        per_j = [(j, min(fan[j], V - (j < k))) for j in range(k + 1) if fan[j] > 0]
        js = [j for j, f in per_j for _ in range(f)]
        cols = [i for _, f in per_j for i in range(f)]
        cands = top[torch.tensor(js, dtype=torch.long, device=top.device), torch.tensor(cols, dtype=torch.long, device=top.device)]
        self._cands = (js, cands, None)
        drafted = self._tree(L, js, cands, hit_list, abort) if js else None
        tree: dict[tuple[int, int], Entry] = {}
        if drafted is not None:  # the tree's one read: every branch's candidate and its k tokens
            toks, qs = drafted
            got = read(torch.cat([cands[:, None], toks], dim=1), "tree")
            self._cands = (js, cands, [r[0] for r in got])
            tree = {(j, r[0]): (tuple(r[1:]), None if qs is None else qs[b]) for b, (j, r) in enumerate(zip(js, got))}
            self._scratch.index = {key: b for b, key in enumerate(tree)}  # type: ignore[union-attr]
        self.tree, self.predicted = tree, _predicted(self._branches())
        self.build_s = time.perf_counter() - t0
        if self.fallback == "auto":  # what the fast backup would have proposed this round
            self.fb_stats.proposal = self._fast()[0]

    @property
    def building(self) -> frozenset[tuple[int, int]]:
        """The outcomes the tree being built answers: read (once) only when a request arrives mid-tree."""
        return frozenset(self._branches())

    def _branches(self) -> list[tuple[int, int]]:
        js, cands, got = self._cands
        if got is None and js:
            got = read(cands, "tree candidates")
            self._cands = (js, cands, got)
        return list(zip(js, got or []))

    def _tree(self, L: int, js: list[int], cands: torch.Tensor, hit_list: list[int], abort: Callable[[], bool]) -> tuple[torch.Tensor, torch.Tensor | Support | None] | None:
        """Draft k tokens for B branches at once; branch b is ``ctx + [bonus, d_1..d_{j_b}, c_b]``
        (``cands`` [B] on the device: nothing here reads it back).
        Returns tokens [B, k] and q' [B, k, V] or on its support (None under greedy), or None if aborted."""
        k, dev, B = self.k, self.device, len(js)
        base = self.runner.length  # L + k + 1: prefix + glue
        x = cands.to(dev)
        # the tree's whole visibility, one bool matrix kept across the depths (built once, on the device;
        # each depth adds one slot per row): the prefix, the glue up to the row's own accepted length,
        # L..L+j_b, then the branch's tree rows so far
        cols = torch.arange(base + k * B, device=dev)
        mask = cols[None, :] <= L + torch.tensor(js, device=dev)[:, None]  # [B, base + kB]: the prefix and glue up to L + j_b
        own = torch.arange(B, device=dev)
        toks = torch.empty(B, k, dtype=torch.long, device=dev)
        qs: list[torch.Tensor | Support] = []
        depth_logits: list[torch.Tensor] = []
        # each branch is penalized for its own prefix: [bonus, d_1..d_j, c] and its tree tokens so far
        prefixes = [[self.pending, *self.spec[:j]] for j in js]  # type: ignore[index]  # + c_b, on the device
        first = x[:, None]  # the candidates c_b
        for d in range(k):
            if abort():
                return None
            lo = base + d * B
            mask[own, lo + own] = True  # the row's own slot (an ancestor for the depths after it)
            positions = [L + 1 + d + j for j in js]  # RoPE positions of the hypothesised sequences
            logits = fit_vocab(self.runner.step(x, positions, list(range(lo, lo + B)), mask[:, : lo + B]).logits, self.vocab)  # [B, V]
            depth_logits.append(logits)
            fan = hit_list[d] if hit_list else 0
            drawn = torch.cat([first, toks[:, :d]], dim=1) if self.pen.active else None
            x, q = draw_depth(logits, self.pen, prefixes, drawn, self.params, self.saguaro_c, self.gen, fan + 1 if fan > 0 else 0)
            toks[:, d] = x
            if q is not None:
                qs.append(q)
        # keep the scratch region: on a hit the winning branch's KV and logits replace the glue forward
        self._scratch = _Scratch(base, B, {}, depth_logits)  # its index once the candidates are read
        return toks, (stack(qs, 1) if qs else None)

    def _settle(self) -> None:
        """The bookkeeping a hit leaves for after its reply has gone out: the outcome, then the branch's KV."""
        if self._later is not None:
            k_prev, bonus, verify_s, last, tokens = self._later
            self._later = None
            self._commit(k_prev, bonus, verify_s, *last)
            self._adopt((k_prev, bonus), tokens)
            self._scratch = None  # the tree it was drafted in is spent

    def _adopt(self, key: tuple[int, int], tokens: tuple[int, ...]) -> None:
        """On a hit, make the winning branch's tree KV the main sequence (no recomputation): keep the
        committed prefix, then the branch's k slots [c, e_1..e_{k-1}] (their RoPE positions were
        already the real ones), and keep its per-depth logits as g_0..g_{k-1}, so the next glue is a
        single-token forward.  Falls back to a full glue if anything does not fit."""
        sc = self._scratch
        if sc is None or key not in sc.index or len(self.kv_ids) != sc.base:
            return
        b, keep = sc.index[key], len(self.ctx)
        if not self.runner.adopt(keep, [sc.base + d * sc.width + b for d in range(self.k)]):
            return
        self.kv_ids = self.ctx + [key[1], *tokens[:-1]]
        self._glue_logits = [lg[b] for lg in sc.depth_logits]

    # -- helpers ----------------------------------------------------------------------------------
    def _lists(self) -> tuple[list[int], list[int]]:
        return self.fan.lists() if self.fan is not None else ([], [])

    def _draw(self, logits: torch.Tensor, fan: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tokens [n] for logits [n, V] and the q' [n, V] they were drawn from (None under greedy),
        Saguaro-reshaped over the top ``fan + 1`` (the candidates a bonus can come from)."""
        p = self.params
        return draw_draft(logits, p.temperature, p.top_k, p.top_p, self.gen, self.saguaro_c, fan + 1 if fan > 0 else 0)  # type: ignore[return-value]

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Append ``ids`` to the draft's sequence (dropping a tree's scratch rows); logits [len(ids), V]."""
        out = self.runner.append(ids).logits
        self.kv_ids.extend(ids)
        return fit_vocab(out, self.vocab)

    def _extend(self, ids: list[int], logits_from: int) -> torch.Tensor:
        """Make the cache hold exactly ``ids``, reusing the common prefix, and return the logits of
        positions ``logits_from..len(ids)-1`` (recomputing from there if needed)."""
        n = 0
        lim = min(len(self.kv_ids), len(ids), logits_from)
        while n < lim and self.kv_ids[n] == ids[n]:
            n += 1
        self.runner.truncate(n)
        del self.kv_ids[n:]
        if n == len(ids):
            return torch.empty(0, device=self.device)
        if logits_from >= len(ids):  # nothing to return: no head over the new rows
            self.runner.append(ids[n:], logits="none")
            self.kv_ids.extend(ids[n:])
            return torch.empty(0, device=self.device)
        return self._forward(ids[n:])[logits_from - n:]


def _predicted(branches: list[tuple[int, int]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The branches (j, candidate), in order, grouped per j: ((j, candidates), ...)."""
    out: dict[int, list[int]] = {}
    for j, c in branches:
        out.setdefault(j, []).append(c)
    return tuple((j, tuple(cs)) for j, cs in out.items())
