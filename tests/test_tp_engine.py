"""The decoders on a tensor-parallel target (two gloo ranks on the CPU): AR, SD and SSD through the Engine
equal the single-process decoders token for token, SSD samples the target's distribution, and a rank lost
mid-reply ends that reply with one error line and is started again for the next."""

from __future__ import annotations

import pytest
import torch

from ssd_chat.engine.tp import load as tp_load
from ssd_chat.engine.decode.ar import ARDecoder
from ssd_chat.engine.config import EngineConfig
from ssd_chat.engine.load.devices import Placement
from ssd_chat.engine.engine import Engine
from ssd_chat.engine.events import Done, Error, Notice, Round
from ssd_chat.engine.params import SamplingParams

from helpers.models import CharTokenizer, as_loaded, perturbed, tiny_llama
from helpers.distribution import decoder_distribution_test
from helpers.tp import alive, rank_cores, save

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ([1, 2, 3], [5, 17, 40, 2, 9])


def tp_target(folder, tokenizer, name: str, k: int = 3):
    cores = rank_cores(2)
    place = Placement(torch.device("cpu"), torch.float64, tuple(c for r in cores for c in r) if cores else None,
                      ranks=("cpu", "cpu"), rank_cores=tuple(cores) if cores else None)
    return tp_load.start(folder, place, name, "off", (1, k + 1), tokenizer)


def reply(engine, prompt, **kw) -> tuple[list, Done]:
    evs = list(engine.stream(prompt, SamplingParams(**kw)))
    assert isinstance(evs[-1], Done), evs[-1]
    return evs, evs[-1]


@pytest.fixture(scope="module")
def with_tp(tmp_path_factory):
    base = tiny_llama(head_scale=3.0)
    folder = save(base, tmp_path_factory.mktemp("t"))
    tp = tp_target(folder, CharTokenizer(64), "t")
    yield as_loaded(base, CharTokenizer(64), "t"), tp, as_loaded(perturbed(base, 0.1), CharTokenizer(64), "d")
    tp.forwards.close()


def test_ar_sd_and_ssd_on_two_ranks_equal_single_process_ar(with_tp):
    one, tp, draft = with_tp
    engine = Engine(EngineConfig(mode="ar", k=3), tp, draft)
    try:
        for prompt in PROMPTS:
            want = list(ARDecoder(one).stream(prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))[-1].token_ids
            for mode in ("ar", "sd", "ssd"):
                engine.reconfigure(mode=mode, fan_out="geometric")
                evs, done = reply(engine, prompt, temperature=0.0, max_new_tokens=20)
                assert done.token_ids == want, (mode, prompt)
                if mode == "ssd":  # the speculator ran, in its own process, and its cache answered
                    rounds = [e for e in evs if isinstance(e, Round)]
                    assert engine.decoder().worker_pid is not None and any(r.cache_hit for r in rounds)
        assert engine.describe()["forward"] == "core eager, 2 tensor-parallel ranks"
        assert engine.describe()["target_device"].startswith("tensor-parallel over 2 ranks")
    finally:
        engine.close()


def test_engine_close_stops_the_ranks_and_the_next_reply_starts_them(with_tp):
    one, tp, _ = with_tp
    engine = Engine(EngineConfig(mode="ar"), tp)
    try:
        reply(engine, [1, 2, 3], temperature=0.0, max_new_tokens=2)  # the ranks run (an earlier test may have closed them)
        pids = tp.forwards.sharded.pids
        assert pids and alive(pids) == pids
        engine.close()
        assert alive(pids) == [] and tp.forwards.sharded.pids == []
        evs, done = reply(engine, [1, 2, 3], temperature=0.0, max_new_tokens=8)
        assert any(isinstance(e, Notice) and "tensor-parallel ranks of t again" in e.message for e in evs)
        want = list(ARDecoder(one).stream([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=8)))[-1].token_ids
        assert done.token_ids == want
    finally:
        engine.close()  # one tensor-parallel model per process: the next fixture starts its own


@pytest.fixture(scope="module")
def small_with_tp(tmp_path_factory):
    base = tiny_llama(vocab_size=8, seed=3, head_scale=1.5)
    tp = tp_target(save(base, tmp_path_factory.mktemp("t8")), CharTokenizer(8), "t8", k=2)
    yield as_loaded(base, CharTokenizer(8), "t8"), tp, as_loaded(perturbed(base, 0.3), CharTokenizer(8), "d8")
    tp.forwards.close()


def test_ssd_with_a_tensor_parallel_target_samples_the_target_distribution(small_with_tp):
    one, tp, draft = small_with_tp
    engine = Engine(EngineConfig(mode="ssd", k=2, fan_out="uniform:2", saguaro_c=0.5), tp, draft)
    try:
        res = decoder_distribution_test(engine.stream, one, [1, 4, 2], SamplingParams(temperature=1.0), n=3, num_samples=800)
        assert res.p_value > 1e-3, res
    finally:
        engine.close()


def test_the_same_check_rejects_a_tensor_parallel_target_with_a_wrong_head(small_with_tp, monkeypatch):
    one, tp, draft = small_with_tp
    engine = Engine(EngineConfig(mode="sd", k=2), tp, draft)
    head = tp.forwards.sharded.core(lambda _s: None).core.head
    real = head._gather
    monkeypatch.setattr(head, "_gather", lambda local: real(local).roll(4, dims=-1))  # vocabulary blocks swapped
    try:
        res = decoder_distribution_test(engine.stream, one, [1, 4, 2], SamplingParams(temperature=1.0), n=2, num_samples=400)
        assert res.p_value < 1e-3, res
    finally:
        engine.close()


def test_a_rank_that_dies_mid_reply_ends_it_in_one_line_and_the_next_reply_restarts_the_ranks(tmp_path, monkeypatch):
    base = tiny_llama(head_scale=3.0)
    monkeypatch.setattr(tp_load.Sharded, "fault", {1: "exit:6"})  # rank 1 exits in its 6th forward
    tp = tp_target(save(base, tmp_path), CharTokenizer(64), "t")
    engine = Engine(EngineConfig(mode="ssd", k=3), tp, as_loaded(perturbed(base, 0.1), CharTokenizer(64), "d"))
    pids = tp.forwards.sharded.pids
    try:
        evs = list(engine.stream([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=40)))
        err = evs[-1]
        assert isinstance(err, Error) and "\n" not in err.message, evs[-1]
        assert err.message.startswith("tensor-parallel 't': rank 1 (pid ") and "exited with status" in err.message
        assert "they start again with the next message" in err.message
        assert 0 < len(err.token_ids) < 40  # what was produced before the rank died is kept
        assert alive(pids) == []
        want = list(ARDecoder(as_loaded(base, CharTokenizer(64), "t")).stream([5, 17, 40], SamplingParams(
            temperature=0.0, max_new_tokens=12)))[-1].token_ids
        assert reply(engine, [5, 17, 40], temperature=0.0, max_new_tokens=12)[1].token_ids == want
        new = tp.forwards.sharded.pids
        assert new and set(new).isdisjoint(pids) and alive(new) == new
    finally:
        engine.close()
    assert alive(tp.forwards.sharded.pids + pids) == []


@pytest.mark.slow
def test_the_packaged_model_on_two_ranks_decodes_as_one_process(smollm2):
    """The user's path: Engine.load with ``--target-device cpu:0,cpu:1`` (the GGUF's float32 copy split over two
    ranks, the default trained draft derived from a whole copy); greedy AR, SD and SSD equal one process's AR
    (the session's float32 SmolLM2: what ``Engine.load(mode="ar", dtype="float32")`` loads)."""
    from ssd_chat.engine.load import chat

    ref = Engine(EngineConfig(mode="ar"), smollm2)
    engine = Engine.load(EngineConfig(mode="sd", target_device="cpu:0,cpu:1", k=2))
    try:
        assert engine.describe()["target_device"] == "tensor-parallel over 2 ranks (cpu core 0, cpu core 1) float32"
        for text in ("Write one sentence about the sea.", "List three prime numbers."):
            prompt = chat.prompt_ids(ref.tokenizer, [{"role": "user", "content": text}])[0]
            want = reply(ref, prompt, temperature=0.0, max_new_tokens=24)[1].token_ids
            for mode in ("ar", "sd", "ssd"):
                engine.reconfigure(mode=mode)
                evs, done = reply(engine, prompt, temperature=0.0, max_new_tokens=24)
                assert done.token_ids == want, (mode, text)
            assert any(isinstance(e, Round) and e.cache_hit for e in evs)  # SSD: the speculator's cache answered
    finally:
        engine.close()
