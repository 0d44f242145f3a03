"""Tools over the API: shown to a chat template that supports them, calls read back from the reply
(Qwen's <tool_call> blocks, Llama 3.1's JSON), streamed and whole; refused (400) when the template
cannot show them, unless the client or the server opts out."""

from __future__ import annotations

import json

import pytest

from helpers.server import client, engine, MSG, post, running
from ssd_chat.server import tools as server_tools
from ssd_chat.engine import Engine, EngineConfig, SamplingParams
from ssd_chat.server.app import create_app

pytestmark = pytest.mark.usefixtures("one_thread")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# Qwen2.5/Qwen3's tool prompt, shortened: the tools as JSON in the system turn, calls in <tool_call> tags
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tc in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CALL = 'I will look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# -- the text level ---------------------------------------------------------------------------------
def test_calls_are_read_in_qwen_and_llama_formats():
    content, calls = server_tools.parse(CALL, {"get_weather"})
    assert content == "I will look." and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; {"name": "get_weather", "parameters": {}}'
    content, calls = server_tools.parse(llama, {"get_weather"})
    assert content is None and [c["function"]["arguments"] for c in calls] == ['{"city": "Rome"}', "{}"]
    for text in ('{"name": "something_else", "parameters": {}}', '{"answer": 42}', "<tool_call>not json</tool_call>", "plain"):
        assert server_tools.parse(text, {"get_weather"}) == (text, [])


def test_streamed_text_is_held_back_only_where_a_call_may_begin():
    s = server_tools.ToolStream({"get_weather"})
    shown = [s.feed(d) for d in ["I will", " look.", "<tool", "_call>\n{\"name\": \"get_weather\",", " \"arguments\": {}}", "</tool_call>"]]
    assert shown == ["I will", " look.", "", "", "", ""]
    content, calls = s.finish()
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    s = server_tools.ToolStream({"get_weather"})
    assert [s.feed(d) for d in ["a <", "b", " <tool", "s>"]] == ["a ", "<b", " ", "<tools>"]  # never a call: all shown
    assert s.finish() == (None, [])
    s = server_tools.ToolStream({"get_weather"})
    assert [s.feed(d) for d in ['{"answer"', ": 1}"]] == ["", ""]  # may be Llama's JSON: held to the end
    assert s.finish() == ('{"answer": 1}', [])


def test_which_templates_take_tools(smol_tokenizer):
    assert not server_tools.template_supports_tools(smol_tokenizer)  # SmolLM2's template ignores them
    assert server_tools.template_supports_tools(type("T", (), {"chat_template": QWEN_TOOLS_TEMPLATE})())


# -- over HTTP ---------------------------------------------------------------------------------------
def test_tools_for_a_template_without_them_are_refused_unless_opted_out(loaded):
    body = {"messages": MSG, "max_tokens": 3, "tools": TOOLS}
    with running(create_app(engine(loaded), SamplingParams(max_new_tokens=8))) as url:
        status, _h, out = post(f"{url}/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == "tools" and "--ignore-tools" in out["error"]["message"]
        status, headers, out = post(f"{url}/v1/chat/completions", {**body, "tool_choice": "none"})
        assert status == 200 and "tool_choice is none" in headers["x-ssd-chat-tools"]
        status, _h, out = post(f"{url}/v1/chat/completions", {**body, "tool_choice": "required"})
        assert status == 400 and out["error"]["param"] == "tool_choice"
    with running(create_app(engine(loaded), SamplingParams(max_new_tokens=8), ignore_tools=True)) as url:
        status, headers, out = post(f"{url}/v1/chat/completions", body)
        assert status == 200 and "--ignore-tools" in headers["x-ssd-chat-tools"] and "tool_calls" not in out["choices"][0]["message"]


@pytest.fixture(scope="module")
def tools_engine(tiny_chat_dir, tmp_path_factory):
    """The tiny model with a tokenizer whose chat template shows tools (Qwen's format)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tools") / "tiny-tools"
    AutoModelForCausalLM.from_pretrained(tiny_chat_dir).save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(tiny_chat_dir)
    tok.chat_template = QWEN_TOOLS_TEMPLATE
    tok.save_pretrained(folder)
    return Engine.load(EngineConfig(target=str(folder), mode="ar"))


@pytest.fixture
def scripted(tools_engine, monkeypatch):
    """The model 'says' a given text: AR's sampler returns its tokens, then end of turn."""
    tok = tools_engine.tokenizer
    queue: list[int] = []

    def say(text: str) -> None:
        queue[:] = list(tok(text, add_special_tokens=False)["input_ids"]) + [tok.convert_tokens_to_ids("<|im_end|>")]

    monkeypatch.setattr("ssd_chat.engine.decode.ar.sample_next", lambda *a, **k: queue.pop(0))
    return say


def test_a_tool_call_is_returned_whole_and_streamed(tools_engine, scripted):
    app = create_app(tools_engine, SamplingParams(max_new_tokens=64))
    with running(app) as url:
        scripted(CALL)
        status, _h, out = post(f"{url}/v1/chat/completions", {"messages": MSG, "tools": TOOLS, "return_token_ids": True})
        assert status == 200, out
        choice = out["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will look."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        prompt = tools_engine.tokenizer.decode(out["prompt_token_ids"])
        assert "<tools>" in prompt and '"name": "get_weather"' in prompt  # the template showed the tools

        scripted(CALL)
        chunks = list(client(url).chat.completions.create(model=tools_engine.config.target, messages=MSG, tools=TOOLS, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.content or "" for d in deltas) == "I will look."
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [(0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # the client runs the tool and sends its answer back; a text reply then ends as "stop"
        scripted("It is sunny in Paris.")
        history = MSG + [{"role": "assistant", "content": None, "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
        status, _h, out = post(f"{url}/v1/chat/completions", {"messages": history, "tools": TOOLS, "return_token_ids": True})
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
        assert "<tool_response>\nsunny, 21 C\n</tool_response>" in tools_engine.tokenizer.decode(out["prompt_token_ids"])
