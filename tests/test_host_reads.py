"""The host-read budget: an SD or SSD round reads the device once, the speculator at most once per
request and once per tree.  On a GPU each read waits for every queued kernel, so a read per draft
step costs a sync per step; on the CPU the reads are counted instead.

Two counts: the reads through :func:`host.read` (by purpose), and every device→host read at all
(``item``, ``tolist``, ``int``, ``float``, ``bool``, ``__index__``, ``cpu``, ``numpy`` patched on
``torch.Tensor``), so a read that bypasses the helper is caught too."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from ssd_chat.engine.sampling import host
from ssd_chat.engine.decode.sd import SDDecoder
from ssd_chat.engine.decode.ssd import SSDDecoder
from ssd_chat.engine.engine import Engine, EngineConfig
from ssd_chat.engine.events import Round
from ssd_chat.engine.params import SamplingParams
from ssd_chat.engine.speculate.channel import Begin
from ssd_chat.engine.fanout import parse
from ssd_chat.engine.speculate.speculator import Speculator

PROMPT = [1, 2, 3, 4, 5]
READS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy")
SAMPLINGS = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3},
             {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3, "frequency_penalty": 0.2, "seed": 4}]


@pytest.fixture(scope="module")
def sharp_pair():
    target = tiny_llama(vocab_size=64)
    return as_loaded(target, CharTokenizer(64), "t"), as_loaded(perturbed(target, 0.2), CharTokenizer(64), "d")


class Raw:
    """Every device→host read this thread makes while active."""

    def __init__(self) -> None:
        self.n = 0
        self.thread = threading.get_ident()


@pytest.fixture
def raw(monkeypatch):
    spy = Raw()

    def wrap(name):
        f = getattr(torch.Tensor, name)

        def counted(self, *a, **kw):
            if threading.get_ident() == spy.thread:
                spy.n += 1
            return f(self, *a, **kw)
        return counted

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    return spy


def per_round(stream, raw: Raw) -> list[tuple[Counter, int]]:
    """(helper reads by purpose, all reads) for each round after the first (the first also prefills)."""
    out = []
    with host.counting() as c:
        last, raw.n = Counter(c), 0
        for ev in stream:
            if isinstance(ev, Round):
                out.append((c - last, raw.n))
                last, raw.n = Counter(c), 0
    assert len(out) > 3, "too few rounds to count"
    return out[1:]


def split(c: Counter) -> tuple[Counter, int]:
    """(the device reads by purpose, the count of :func:`host.on_host` reads of CPU tensors)."""
    return Counter({k: v for k, v in c.items() if not k.startswith("cpu: ")}), sum(v for k, v in c.items() if k.startswith("cpu: "))


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "sampled", "penalized"])
def test_an_sd_round_reads_the_device_once(sharp_pair, raw, params):
    """The draft loop keeps its tokens on the device, the acceptance test runs there, and the round
    reads the drafts, the accepted length and the bonus in one go.  On the CPU the top-k sampler also
    reads its tie check (a CPU tensor: no sync); nothing else is read."""
    dec = SDDecoder(Engine(EngineConfig(mode="sd", k=4), *sharp_pair))
    for helper, total in per_round(dec.stream(PROMPT, SamplingParams(max_new_tokens=40, **params)), raw):
        device, on_cpu = split(helper)
        assert device == Counter(round=1) and total == 1 + on_cpu, (helper, total)
        assert on_cpu == 0 or set(helper) == {"round", "cpu: tie check"}


def test_an_sd_round_on_the_dense_sampler_reads_once_in_all(sharp_pair, raw, monkeypatch):
    """Off the CPU the sampler takes the dense path (no tie check): the round's one read is all."""
    from ssd_chat.engine.sampling import sampling

    monkeypatch.setattr(sampling, "top_support", lambda *a, **kw: None)
    dec = SDDecoder(Engine(EngineConfig(mode="sd", k=4), *sharp_pair))
    for helper, total in per_round(dec.stream(PROMPT, SamplingParams(max_new_tokens=40, **SAMPLINGS[2])), raw):
        assert helper == Counter(round=1) and total == 1, (helper, total)


def test_on_host_refuses_a_tensor_off_the_cpu():
    with pytest.raises(ValueError, match="use read"):
        host.on_host(torch.zeros(1, device="meta"), "x")


def test_an_ssd_round_reads_the_device_once(sharp_pair, raw):
    """The verifier's side: one read per round (the speculator runs in its own process)."""
    dec = SSDDecoder(Engine(EngineConfig(mode="ssd", k=3, fan_out="uniform:2"), *sharp_pair))
    try:
        for helper, total in per_round(dec.stream(PROMPT, SamplingParams(max_new_tokens=30, temperature=1.0, seed=2)), raw):
            assert helper == Counter(round=1) and total == 1, (helper, total)
    finally:
        dec.close()


@pytest.mark.parametrize("params", SAMPLINGS, ids=["greedy", "sampled", "penalized"])
def test_the_speculator_reads_once_per_request_and_once_per_tree(sharp_pair, raw, params):
    """Serving a request reads at most once (a miss: the neural fallback's k tokens; a hit: nothing,
    the tree was read when it was built), and building the tree reads once (every branch's candidate
    and its k tokens), the glue, the candidates and the k depths staying on the device."""
    _, draft = sharp_pair
    k = 4
    sp = Speculator(draft.forwards, k, parse("uniform:2", k), "neural", vocab=64)
    sp.begin(Begin(tuple(PROMPT), SamplingParams(**params)))
    seen = Counter()
    req, k_prev, bonus = 1, -1, 11
    for _ in range(6):
        with host.counting() as c:
            raw.n = 0
            reply, _ = sp.serve(req, k_prev, bonus)
            device, _ = split(c)
            assert raw.n == sum(c.values()) and sum(device.values()) <= 1 and c["neural drafts"] == (not reply.hit), (reply, c, raw.n)
        with host.counting() as c:
            raw.n = 0
            sp.build()
            device, on_cpu = split(c)
            assert raw.n == 1 + on_cpu and device == Counter(tree=1), (c, raw.n)
        seen["hit" if reply.hit else "miss"] += 1
        # the next request: a hit on an even turn (a branch of the tree), a miss on an odd one
        hit = req % 2 == 0
        k_prev, bonus = next(iter(sp.tree)) if hit else next((j, t) for j in range(k + 1) for t in range(64) if (j, t) not in sp.tree)
        req += 1
    assert seen["hit"] >= 2 and seen["miss"] >= 2, seen


def test_the_tree_candidates_are_read_only_when_a_request_arrives_mid_tree(sharp_pair, raw):
    """The worker's abort check asks for the outcomes the tree answers only when a request is waiting;
    that is one read, and the tree's own read after it still makes one."""
    from ssd_chat.engine.speculate.channel import Spec
    from ssd_chat.engine.speculate.process import stops_tree

    _, draft = sharp_pair
    k = 3
    sp = Speculator(draft.forwards, k, parse("uniform:2", k), "neural", vocab=64)
    sp.begin(Begin(tuple(PROMPT), SamplingParams(seed=0)))
    sp.serve(1, -1, 11)
    with host.counting() as c:
        sp.build(lambda: False)
    assert c == Counter(tree=1)
    reply, _ = sp.serve(2, *next(iter(sp.tree)))
    asked = []
    with host.counting() as c:
        miss = Spec(3, 0, reply.tokens[0], 0.0)  # the token drafted at j = 0 is never a candidate there
        sp.build(lambda: asked.append(stops_tree(miss, sp.building)) or asked[-1])
    assert asked == [True] and sp.tree == {} and c == Counter({"tree candidates": 1}), (asked, c)
