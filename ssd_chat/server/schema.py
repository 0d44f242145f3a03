"""The OpenAI request bodies the server accepts, and OpenAI-style error objects.

Requests are validated strictly (a string where a number belongs is an error, not coerced),
and what the engine cannot do (several choices, logit_bias) is refused with
a 400 that says so, rather than silently ignored.  Unknown fields are ignored: clients send
many optional ones.  Extensions, as in vLLM: ``top_k``, ``repetition_penalty``, ``ignore_eos``, ``return_token_ids``,
and ours, ``ssd_mode`` (decode this request with another mode the loaded draft allows).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from ..chat.stats import SAMPLING_SHOWN
from ..engine import MAX_LOGPROBS, SEED_MAX, SamplingParams


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
                      "param": param, "code": code}}


def describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One sentence (and the offending parameter) for pydantic's errors on a request body."""
    # of a union's failed members, the one our own check (a value_error) rejected says the most
    e = next((x for x in errors if x.get("type") == "value_error"), errors[0])
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})", None
    if not loc and e.get("type") in ("model_attributes_type", "dict_type", "model_type"):
        return "the request body must be a JSON object", None
    # drop pydantic's union-member labels such as 'str' / 'list[TextPart]' from the path
    param = ".".join(p for p in loc if not (p[:1].isalpha() and ("[" in p or p in ("str", "int", "float", "bool", "list"))))
    return f"{param or 'body'}: {e.get('msg', 'invalid value')}", param or None


def _utf8(s: str) -> str:
    # JSON may carry a lone surrogate ("\\ud800"), which no tokenizer can encode
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text has a lone surrogate ({s[e.start]!r} at character {e.start}), which is not valid Unicode text") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionDef(_Strict):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(_Strict):
    name: Text
    arguments: Text  # JSON, as OpenAI sends it


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it ("developer" is the newer name of the system role;
        a call's arguments as an object, which Qwen's and Llama's templates write out as JSON)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)  # vLLM's convention: -1 (or 0) is off
    max_tokens: int | None = Field(None, ge=0)  # 0: only with a completion's echo (its prompt's logprobs)
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    n: int = Field(1, ge=1)
    # OpenAI's range; applied exactly in every mode (the verifier penalizes each row for its own prefix)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, allow_inf_nan=False)  # vLLM's extension (1 = off)
    logit_bias: dict[str, float] | None = None
    ssd_mode: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False

    def check_supported(self) -> None:
        if self.max_tokens == 0 and not getattr(self, "echo", False):
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo, for the prompt's logprobs)", "max_tokens")
        if self.n != 1:
            raise APIError(400, "n must be 1: the engine decodes one reply per request", "n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if self.stop == "" or (isinstance(self.stop, list) and any(not s for s in self.stop)):
            raise APIError(400, "stop strings must not be empty", "stop")

    def sampling(self, defaults: SamplingParams, max_new_tokens: int, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
        """This request's settings over the server's defaults (``--temperature`` etc.)."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        own = self.model_dump(include=set(SAMPLING_SHOWN), exclude_none=True)
        if "top_k" in own:
            own["top_k"] = max(0, own["top_k"])  # -1: off
        return replace(defaults, **own, max_new_tokens=max_new_tokens, stop=stop + tuple(extra_stop), ignore_eos=self.ignore_eos,
                       logprobs=self.top_wanted())

    def top_wanted(self) -> int | None:
        """How many alternatives per emitted token the reply's logprobs show; None: no logprobs."""
        raise NotImplementedError


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        # The model decides whether to call a tool (the server cannot force its output to be a call)
        if self.tools and self.tool_choice not in (None, "auto", "none"):
            raise APIError(400, "tool_choice must be auto or none: the model chooses whether to call a tool, and nothing forces its output to be a call", "tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise APIError(400, "response_format other than text is not supported", "response_format")
        if self.messages[-1].role == "assistant":
            raise APIError(400, "the last message must not be the assistant's: there is nothing to answer", "messages")

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def chat(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class CompletionRequest(_Common):
    # a batch of one (lm-eval sends its token ids so: [[...]])
    prompt: Text | list[Text] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: Text | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)) and len(self.prompt) != 1:
            raise APIError(400, "one prompt per request: the engine decodes one reply at a time", "prompt")

    @property
    def wanted_tokens(self) -> int | None:
        return self.max_tokens

    def top_wanted(self) -> int | None:
        return self.logprobs

    def text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]
