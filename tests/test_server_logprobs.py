"""Logprobs in ``serve``: OpenAI's chat shape and the legacy/vLLM completion shape (echo included),
with values that are the target's own raw log-probabilities in every mode, checked against one
plain forward over prompt + reply."""

from __future__ import annotations

import pytest
import torch

from helpers.server import post, running
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.server.app import create_app

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

MSG = [{"role": "user", "content": "What is the capital of France?"}]
TOL = 1e-4


@pytest.fixture(scope="module")
def server(loaded):
    target, draft = loaded
    app = create_app(Engine(EngineConfig(target=target.name, mode="sd", draft="layers:1"), target, draft), SamplingParams(max_new_tokens=16))
    with running(app) as url:
        yield url


def truth(loaded, ids: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits at every position of ``ids``, from one transformers forward."""
    model = loaded[0].model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def chat_ids(loaded, messages) -> list[int]:
    target, draft = loaded
    return Engine(EngineConfig(target=target.name, mode="ar"), target, None).prompt_ids(messages)[0]


def check_content(loaded, prompt: list[int], out_ids: list[int], content: list[dict], top: int) -> None:
    """Each reply token's logprob and top alternatives are the target's, in order."""
    lp = truth(loaded, prompt + out_ids)
    texts = loaded[0].tokenizer
    assert len(content) == len(out_ids)
    for j, (tid, entry) in enumerate(zip(out_ids, content)):
        row = lp[len(prompt) + j - 1]
        assert abs(entry["logprob"] - row[tid].item()) < TOL
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert len(entry["top_logprobs"]) == top
        want = row.topk(top)
        for alt, v, i in zip(entry["top_logprobs"], want.values.tolist(), want.indices.tolist()):
            assert abs(alt["logprob"] - v) < TOL
            assert alt["token"] == bytes(alt["bytes"]).decode("utf-8", "replace")
        # bytes are the token's own: its pieces join to the reply's bytes
        assert bytes(entry["bytes"]) == texts.decode([tid]).encode() or "\ufffd" in texts.decode([tid])


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_chat_logprobs_are_the_targets_in_every_mode(server, loaded, mode, temperature):
    body = {"messages": MSG, "max_tokens": 10, "temperature": temperature, "seed": 3, "logprobs": True, "top_logprobs": 3,
            "return_token_ids": True, "ssd_mode": mode, "repetition_penalty": 1.3}
    status, _h, out = post(f"{server}/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    assert out["ssd_stats"]["mode"] == mode
    check_content(loaded, chat_ids(loaded, MSG), choice["token_ids"], choice["logprobs"]["content"], 3)
    assert choice["logprobs"]["refusal"] is None


def test_greedy_logprobs_agree_across_modes(server):
    got = {}
    for mode in ("ar", "sd", "ssd"):
        body = {"messages": MSG, "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 2, "ssd_mode": mode}
        got[mode] = post(f"{server}/v1/chat/completions", body)[2]["choices"][0]["logprobs"]["content"]
    for mode in ("sd", "ssd"):
        assert [e["token"] for e in got[mode]] == [e["token"] for e in got["ar"]]
        for a, b in zip(got[mode], got["ar"]):
            assert abs(a["logprob"] - b["logprob"]) < TOL
            assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]


def test_streamed_chat_logprobs_match_the_whole_answer(server, loaded):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)
    kw = {"model": loaded[0].name, "messages": MSG, "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = c.chat.completions.create(**kw)
    streamed = [e for ch in c.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in whole.choices[0].logprobs.content]
    assert "".join(e.token for e in whole.choices[0].logprobs.content) == whole.choices[0].message.content
    plain = c.chat.completions.create(model=loaded[0].name, messages=MSG, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("mode", ["ar", "ssd"])
@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_completion_echo_gives_the_prompts_logprobs(server, loaded, mode, max_tokens):
    tok = loaded[0].tokenizer
    prompt = tok("The capital of France is Paris, and the capital of Italy is")["input_ids"]
    body = {"prompt": [prompt], "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "echo": True, "ssd_mode": mode,
            "return_token_ids": True}
    status, _h, out = post(f"{server}/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    lps = choice["logprobs"]
    reply = choice["token_ids"]
    ended = choice["finish_reason"] == "stop"  # on EOS: listed last, as vLLM's (lm-eval reads the list so)
    assert len(reply) == max_tokens or (ended and len(reply) < max_tokens)
    ids = prompt + reply + ([lps and tok.convert_tokens_to_ids(tok.eos_token)] if ended else [])
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(lps["top_logprobs"]) == len(lps["text_offset"]) == len(ids)
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert choice["text"] == tok.decode(prompt) + tok.decode(reply, skip_special_tokens=True)
    lp = truth(loaded, ids)
    for t in range(1, len(ids)):
        assert abs(lps["token_logprobs"][t] - lp[t - 1, ids[t]].item()) < TOL
        top = lps["top_logprobs"][t]
        assert lps["tokens"][t] in top and 1 <= len(top) <= 2  # the top one, and the chosen one
        assert abs(max(top.values()) - lp[t - 1].max().item()) < TOL
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and all(b == a + len(s) for a, b, s in zip(offsets, offsets[1:], lps["tokens"]))


def test_completion_logprobs_without_echo_and_streamed(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = post(f"{server}/v1/completions", body)[2]["choices"][0]
    assert len(whole["logprobs"]["tokens"]) == 6 and None not in whole["logprobs"]["token_logprobs"]
    assert "".join(whole["logprobs"]["tokens"]) == whole["text"]
    c = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=300)
    chunks = list(c.completions.create(model=None or c.models.list().data[0].id, stream=True, echo=True, **body))
    lp = [ch.choices[0].logprobs for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert lp[0].token_logprobs[0] is None  # the echoed prompt first
    assert [t for x in lp[1:] for t in x.token_logprobs] == whole["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": MSG, "logprobs": 1}, "logprobs"),
    ("chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [[1, 2], [3, 4]], "echo": True, "max_tokens": 0}, "prompt"),
])
def test_bad_logprobs_requests_get_one_clear_400(server, path, body, param):
    status, _h, out = post(f"{server}/v1/{path}", body)
    assert status == 400, out
    assert out["error"]["param"] == param and "\n" not in out["error"]["message"], out
