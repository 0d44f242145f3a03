"""The OpenAI-compatible server in-process: a real uvicorn on a loopback port over a tiny model pair,
driven by the official ``openai`` client and by raw HTTP."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import procs
from helpers.server import client, engine, get, MSG, open_stream, post, read_data_events, running, wait_until
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.engine.events import Done
from ssd_chat.server.app import create_app

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")

def ar_reference(loaded, messages, n: int) -> list[int]:
    """Greedy AR token ids: what every mode must reproduce exactly."""
    e = engine(loaded, "ar", with_draft=False)
    ids, _ = e.prompt_ids(messages)
    done = [ev for ev in e.stream(ids, SamplingParams(max_new_tokens=n)) if isinstance(ev, Done)][0]
    return list(done.token_ids)


@pytest.fixture(scope="module")
def sd_server(loaded):
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=64))
    with running(app) as url:
        yield url, app.state.worker


def test_openai_client_streams_and_answers_whole(sd_server, loaded):
    url, _worker = sd_server
    c = client(url)
    model = c.models.list().data[0].id
    assert model == loaded[0].name
    whole = c.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens == len(whole.choices[0].model_extra["token_ids"]) <= 12
    assert whole.usage.prompt_tokens > 0
    stats = whole.model_extra["ssd_stats"]
    assert stats["mode"] == "sd" and stats["rounds"] > 0 and 0 <= stats["acceptance_rate"] <= 1
    assert stats["mean_accepted_length"] >= 1 and stats["draft"] == "layers:1" and stats["k"] == 2

    chunks = list(c.chat.completions.create(model=model, messages=MSG, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [i for ch in chunks if ch.choices for i in (ch.choices[0].model_extra.get("token_ids") or [])]
    assert text == whole.choices[0].message.content and ids == whole.choices[0].model_extra["token_ids"]
    final = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason][0]
    assert final.model_extra["ssd_stats"]["new_tokens"] == len(ids)
    assert chunks[-1].usage.completion_tokens == len(ids) and chunks[-1].choices == []

    comp = c.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                                                         temperature=0, stream=True) if ch.choices)
    assert comp.choices[0].text == streamed and comp.usage.completion_tokens <= 8 and comp.model_extra["ssd_stats"]["mode"] == "sd"


def test_greedy_over_the_api_equals_ar_and_ask_json(sd_server, loaded, tiny_chat_dir):
    from helpers.cli import cli

    url, _ = sd_server
    expected = ar_reference(loaded, MSG, 16)
    status, _h, body = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == expected
    r = cli("ask", "--json", "--no-server", "--target", str(tiny_chat_dir), "--mode", "sd", "--draft", "layers:1", "-n", "16",
            "--temperature", "0", MSG[0]["content"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == expected


def test_eight_clients_at_once_all_answered_in_arrival_order(sd_server, loaded):
    url, worker = sd_server
    prompts = [f"Question number {i}: name a colour." for i in range(8)]
    expected = {p: ar_reference(loaded, [{"role": "user", "content": p}], 10) for p in prompts}
    before = len(worker.history)
    c = client(url)

    def ask(p):
        r = c.chat.completions.create(model=loaded[0].name, messages=[{"role": "user", "content": p}], max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True})
        return p, r

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, prompts))
    for p, r in results:
        assert r.choices[0].model_extra["token_ids"] == expected[p], p
    jobs = worker.history[before:]
    assert len(jobs) == 8 and all(j.reason in ("length", "eos") for j in jobs)
    # one at a time, started in the order they arrived
    assert [j.id for j in jobs] == sorted(j.id for j in jobs)
    assert all(a.ended_s <= b.started_s for a, b in zip(jobs, jobs[1:]))


def test_a_client_that_hangs_up_frees_the_engine_within_one_round(sd_server, loaded):
    url, worker = sd_server
    before = len(worker.history)
    sock, reader = open_stream(url, {"messages": MSG, "max_tokens": 3000, "ignore_eos": True, "temperature": 0})
    assert len(read_data_events(reader, 4)) == 4  # role chunk + 3 tokens: the long reply is decoding
    waiting: dict = {}
    t = threading.Thread(target=lambda: waiting.update(r=post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 5})))
    t.start()
    wait_until(lambda: worker.waiting == 1)
    reader.close()
    sock.close()  # hang up mid-reply
    t.join(120)
    status, _h, body = waiting["r"]
    assert status == 200 and body["usage"]["completion_tokens"] == 5
    gone, nxt = worker.history[before:before + 2]
    assert gone.reason == "cancelled" and gone.num_tokens < 3000
    assert gone.rounds_after_stop <= 1  # the engine saw the stop at its next round
    assert gone.ended_s <= nxt.started_s


def _gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = get(f"{url}/metrics")[2]
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")}


def test_the_queue_gauges_follow_a_queued_client_that_hangs_up(sd_server):
    url, worker = sd_server
    before = len(worker.history)
    sock_a, reader_a = open_stream(url, {"messages": MSG, "max_tokens": 3000, "ignore_eos": True})
    assert len(read_data_events(reader_a, 3)) == 3  # decoding
    sock_b, reader_b = open_stream(url, {"messages": MSG, "max_tokens": 5})
    wait_until(lambda: worker.waiting == 1)
    assert _gauges(url) == {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 1}
    reader_b.close()
    sock_b.close()  # the queued client hangs up ...
    wait_until(lambda: all(j.stop.is_set() for j in list(worker._queue.queue)))
    reader_a.close()
    sock_a.close()  # ... then the running one: the engine skips the queued job without decoding it
    wait_until(lambda: len(worker.history) == before + 2 and worker.running is None)
    assert [j.reason for j in worker.history[before:]] == ["cancelled", "cancelled"]
    assert worker.history[-1].started_s is None  # never decoded
    health = get(f"{url}/health")[2]
    assert (health["running"], health["waiting"]) == (0, 0)
    assert _gauges(url) == {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0}


def test_a_full_queue_answers_429_with_retry_after(loaded):
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=64), max_queue=1)
    worker = app.state.worker
    with running(app) as url:
        sock, reader = open_stream(url, {"messages": MSG, "max_tokens": 3000, "ignore_eos": True})
        read_data_events(reader, 2)
        queued: dict = {}
        t = threading.Thread(target=lambda: queued.update(r=post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 3})))
        t.start()
        wait_until(lambda: worker.waiting == 1)
        status, headers, body = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 3})
        assert status == 429 and int(headers["retry-after"]) >= 1
        assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
        reader.close()
        sock.close()
        t.join(120)
        assert queued["r"][0] == 200
        _s, _h, metrics = get(f"{url}/metrics")
        assert 'ssd_chat:requests_rejected_total{model_name="' in metrics


@pytest.mark.parametrize("body,status,param", [
    (b'{"messages": [{"role": "user", "content": "hi"}', 400, None),  # malformed JSON
    (b'["not", "an", "object"]', 400, None),
    ({"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"messages": []}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),  # the prompt alone is past the context
    ({"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MSG, "top_p": 0}, 400, "top_p"),
    ({"messages": MSG, "n": 2}, 400, "n"),
    ({"messages": MSG, "ssd_mode": "turbo"}, 400, "ssd_mode"),
    ({"messages": MSG, "stop": [""]}, 400, "stop"),
    ({"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400, "tool_choice"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"messages": MSG, "model": "gpt-4o"}, 404, "model"),
])
def test_bad_input_is_an_openai_error_and_the_server_stays_up(sd_server, body, status, param):
    url, _ = sd_server
    raw = body if isinstance(body, bytes) else None
    got, _h, out = post(f"{url}/v1/chat/completions", body, raw=raw)
    assert got == status, out
    assert set(out["error"]) == {"message", "type", "param", "code"} and out["error"]["message"]
    assert out["error"]["param"] == param and "Traceback" not in json.dumps(out)
    ok, _h, _b = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 2})
    assert ok == 200


def test_other_routes_and_methods_are_openai_errors(sd_server):
    url, _ = sd_server
    status, _h, out = get(f"{url}/v1/nothing-here")
    assert status == 404 and out["error"]["type"] == "not_found_error"
    status, _h, out = get(f"{url}/v1/chat/completions")
    assert status == 405 and "error" in out
    for prompt in ([1, 2, 10**9], []):
        status, _h, out = post(f"{url}/v1/completions", {"prompt": prompt})
        assert status == 400 and out["error"]["param"] == "prompt"


def test_ssd_mode_per_request_then_back(sd_server, loaded):
    url, _ = sd_server
    expected = ar_reference(loaded, MSG, 10)
    for mode in ("ar", None):
        body = {"messages": MSG, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
        if mode:
            body["ssd_mode"] = mode
        status, _h, out = post(f"{url}/v1/chat/completions", body)
        assert status == 200 and out["choices"][0]["token_ids"] == expected
        assert out["ssd_stats"]["mode"] == (mode or "sd")


def test_ssd_mode_needs_a_draft(loaded):
    app = create_app(engine(loaded, "ar", with_draft=False), SamplingParams(max_new_tokens=8))
    with running(app) as url:
        status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "ssd_mode": "sd"})
        assert status == 400 and "without one" in out["error"]["message"]
        _s, _h, models = get(f"{url}/v1/models")
        assert models["data"][0]["ssd"]["modes"] == ["ar"]


def test_api_key_guards_everything_but_health(loaded):
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=4), api_key="sesame")
    with running(app) as url:
        assert get(f"{url}/health")[0] == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
            assert get(f"{url}/v1/models", headers)[0] == 401
            assert get(f"{url}/metrics", headers)[0] == 401
            status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG}, headers)
            assert status == 401 and out["error"]["code"] == "invalid_api_key"
        assert client(url, api_key="sesame").chat.completions.create(model=loaded[0].name, messages=MSG, max_tokens=3).usage.completion_tokens > 0
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="nope").models.list()


def test_the_openapi_schema_lists_every_endpoint_behind_the_key(sd_server, loaded):
    url, _ = sd_server
    status, headers, schema = get(f"{url}/openapi.json")
    assert status == 200 and headers["content-type"].startswith("application/json")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/metrics", "/health"} <= set(schema["paths"])
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert "messages" in schema["components"]["schemas"][body.rsplit("/", 1)[1]]["properties"]
    status, _h, page = get(f"{url}/docs")
    assert status == 200 and "/openapi.json" in page
    app = create_app(engine(loaded), SamplingParams(max_new_tokens=4), api_key="sesame")
    with running(app) as keyed:
        for path in ("/openapi.json", "/docs"):
            status, _h, out = get(f"{keyed}{path}")
            assert status == 401 and out["error"]["code"] == "invalid_api_key"
        status, _h, schema = get(f"{keyed}/openapi.json", {"Authorization": "Bearer sesame"})
        assert status == 200 and "/v1/chat/completions" in schema["paths"]


def test_metrics_use_vllm_spec_decode_names(sd_server):
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = sd_server
    assert post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 6})[0] == 200
    status, headers, text = get(f"{url}/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if "position" not in s.labels}
    drafts, drafted, accepted = (samples[f"vllm:spec_decode_num_{n}_total"] for n in ("drafts", "draft_tokens", "accepted_tokens"))
    assert drafts > 0 and drafts <= drafted <= 2 * drafts and 0 <= accepted <= drafted  # k = 2 (fewer near a reply's end)
    assert samples["vllm:generation_tokens_total"] >= 6 and samples["vllm:num_requests_running"] == 0
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text and 'position="1"' in text


def test_ssd_server_reports_cache_hits_and_leaves_no_speculator(loaded):
    psutil = pytest.importorskip("psutil")
    target, draft = loaded
    e = Engine(EngineConfig(target=target.name, mode="ssd", draft="layers:1"), target, draft)
    app = create_app(e, SamplingParams(max_new_tokens=12))
    expected = ar_reference(loaded, MSG, 12)
    with running(app) as url:
        out = client(url).chat.completions.create(model=target.name, messages=MSG, max_tokens=12, temperature=0,
                                                  extra_body={"return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == expected
        stats = out.model_extra["ssd_stats"]
        assert stats["mode"] == "ssd" and stats["cache_hit_rate"] is not None, stats
        speculators = procs.speculators()
        assert speculators, "SSD ran without its speculator process"
        _s, _h, text = get(f"{url}/metrics")
        assert 'ssd_chat:ssd_cache_lookups_total{model_name="' in text
    gone, alive = psutil.wait_procs(speculators, timeout=30)
    assert not alive


def test_offered_tools_the_template_cannot_show_are_refused_unless_tool_choice_is_none(sd_server):
    """SmolLM2's template has no tools: answering in text as if they were seen would drop them silently."""
    url, _ = sd_server
    tools = [{"type": "function", "function": {"name": "date_time", "parameters": {"type": "object", "properties": {}}}}]
    for choice in (None, "auto", "none"):
        body = {"messages": MSG, "max_tokens": 3, "tools": tools, **({"tool_choice": choice} if choice else {})}
        status, _h, out = post(f"{url}/v1/chat/completions", body)
        if choice == "none":
            assert status == 200 and out["usage"]["completion_tokens"] == 3 and "tool_calls" not in out["choices"][0]["message"]
        else:
            assert status == 400 and out["error"]["param"] == "tools"



@pytest.mark.parametrize("field,bad", [("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0),
                                       ("repetition_penalty", -1.0), ("frequency_penalty", "high")])
def test_penalties_out_of_range_are_400(sd_server, field, bad):
    url, _ = sd_server
    status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 2, field: bad})
    assert status == 400 and out["error"]["param"] == field, out


def test_penalties_over_the_api_are_exact(sd_server, loaded):
    """frequency / presence (OpenAI) and repetition (vLLM) penalties are accepted, and greedy SD with them
    reproduces penalized greedy AR token for token."""
    url, _ = sd_server
    pen = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    e = engine(loaded, "ar", with_draft=False)
    ids, _ = e.prompt_ids(MSG)
    ref = [ev for ev in e.stream(ids, SamplingParams(max_new_tokens=16, **pen)) if isinstance(ev, Done)][0].token_ids
    status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "max_tokens": 16, "temperature": 0, "return_token_ids": True, **pen})
    assert status == 200 and out["choices"][0]["token_ids"] == list(ref), out
