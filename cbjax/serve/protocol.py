"""OpenAI's request schema for completions and chat, and its error body.

Fields OpenAI defines that cbjax cannot honour are accepted only at their neutral value; any
other value, and any field OpenAI (or vLLM's common extensions) does not define, is a 400
naming the field, so a client never silently gets something other than it asked for. Types are
strict (a bool is not a number, a string is not a number, a float is not a token id), a lone
UTF-16 surrogate anywhere in the body is a 400 naming where, and null for an optional field
means its default, as leaving it out does."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo,
                      ValidatorFunctionWrapHandler, field_validator, model_validator)  # fmt: skip
from pydantic_core import PydanticCustomError

# allow_inf_nan: Python's JSON parser reads NaN and Infinity, which JSON has not
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class APIError(Exception):
    """An error answered in OpenAI's body: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 headers: Optional[dict[str, str]] = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("value_error", message)


def _only(neutral: Any) -> AfterValidator:
    """Accepts the field's neutral value only (after the strict type check: `true` is not 1)."""

    def check(value: Any) -> Any:
        if value != neutral:
            raise PydanticCustomError("neutral_only", "only {neutral} is supported", {"neutral": json.dumps(neutral)})
        return value

    return AfterValidator(check)


def surrogate_at(value: Any, where: str = "") -> Optional[str]:
    """Where in a parsed JSON body a string (or an object's key) holds a lone UTF-16
    surrogate, as a field path ('messages[0].content'; '' for the body itself); None if none
    does. Such text has no UTF-8 form: it can be neither tokenized nor echoed back."""
    kind = type(value)
    if kind is str:
        return where if not value.isascii() and _SURROGATE.search(value) else None
    if kind is list:
        for i, item in enumerate(value):
            if type(item) is not int and (found := surrogate_at(item, f"{where}[{i}]")) is not None:
                return found
    elif kind is dict:
        for key, item in value.items():
            if surrogate_at(key) is not None:  # the key itself is not echoed: its object is named
                return where
            if (found := surrogate_at(item, f"{where}.{key}" if where else key)) is not None:
                return found
    return None


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False
    continuous_usage_stats: Annotated[bool, _only(False)] = False


class SamplingFields(BaseModel):
    """What completions and chat share: sampling knobs and the neutral-only OpenAI fields."""

    model_config = STRICT

    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's: -1 and 0 mean off
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # the client id (scheduler=vtc's fairness unit)
    priority: int = 0  # scheduler=priority: lower runs first (vLLM's extension)
    n: Annotated[int, _only(1)] = 1
    presence_penalty: Annotated[float, _only(0.0)] = 0.0
    frequency_penalty: Annotated[float, _only(0.0)] = 0.0
    repetition_penalty: Annotated[float, _only(1.0)] = 1.0
    logit_bias: Optional[dict[str, Annotated[float, _only(0.0)]]] = None
    min_tokens: Annotated[int, _only(0)] = 0
    skip_special_tokens: Annotated[bool, _only(True)] = True

    @model_validator(mode="before")
    @classmethod
    def _screen(cls, data: Any) -> Any:
        """Before any field: a lone surrogate is refused naming where it is (pydantic's own
        messages would echo it, and an echo has no UTF-8 form either); a null optional field
        is dropped, so that it takes its default."""
        where = surrogate_at(data)
        if where is not None:
            where = where or "body"
            message = "holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not valid Unicode text"
            raise APIError(400, f"{where}: {message}", where)
        if isinstance(data, dict):
            required = {name for name, f in cls.model_fields.items() if f.is_required()}
            data = {k: v for k, v in data.items() if v is not None or k in required}
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > 4:
            raise _invalid("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise _invalid("stop sequences must be non-empty")
        return stops

    @field_validator("stream_options")
    @classmethod
    def _streamed(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Optional[StreamOptions]:
        # `stream` is declared first, so it is validated by now (absent here if it failed)
        if value is not None and info.data.get("stream") is False:
            raise _invalid("only allowed when stream is true")
        return value


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int = Field(default=16, ge=1)
    echo: Annotated[bool, _only(False)] = False
    best_of: Optional[Annotated[int, _only(1)]] = None
    logprobs: Optional[Annotated[int, _only(None)]] = None  # 0 asks for the chosen tokens' logprobs: not neutral
    suffix: Optional[Literal[""]] = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Union[str, list[int]]:
        try:
            value = handler(value)
        except ValidationError:  # the union's complaints name its members, not the client's mistake
            raise _invalid("must be a string or a list of integer token ids") from None
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise _invalid("a batch of prompts is not supported: send one prompt per request")
            value = value[0]
        if not value:
            raise _invalid("must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict[str, Any]]]
    name: Optional[str] = None

    def template_dict(self, where: str) -> dict[str, str]:
        """The message as a chat template reads it: role, text and, when given, the name."""
        out = {"role": self.role, "content": self.text(where)}
        if self.name is not None:
            out["name"] = self.name
        return out

    def text(self, where: str) -> str:
        """The message's text; a list of parts may hold text parts only."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}.content[{i}]: only text parts are supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: Annotated[bool, _only(False)] = False
    top_logprobs: Optional[Annotated[int, _only(0)]] = None
    response_format: Optional[dict[str, Literal["text"]]] = None
    tools: Optional[list[Any]] = Field(default=None, max_length=0)
    tool_choice: Optional[Literal["none"]] = None
    parallel_tool_calls: Optional[bool] = None


def error_param(loc: tuple) -> Optional[str]:
    """A pydantic error location as the request field it names: ('body', 'messages', 0,
    'role') -> 'messages[0].role'."""
    parts = [p for p in loc if p != "body"]
    # pydantic names the member of a union it tried ("str", "list[int]"): not the client's field
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "function-after")))]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None
