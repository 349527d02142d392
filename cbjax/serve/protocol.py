"""OpenAI's request schema for completions and chat, and its error body.

Fields OpenAI defines that cbjax cannot honour are accepted only at their neutral value; any
other value, and any field OpenAI (or vLLM's common extensions) does not define, is a 400
naming the field, so a client never silently gets something other than it asked for."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class SamplingFields(BaseModel):
    """What completions and chat share: sampling knobs and the neutral-only OpenAI fields."""

    model_config = ConfigDict(extra="forbid")

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
    n: Literal[1] = 1
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    repetition_penalty: Literal[1, 1.0] = 1.0
    logit_bias: Optional[dict[str, Literal[0, 0.0]]] = None
    min_tokens: Literal[0] = 0
    skip_special_tokens: Literal[True] = True

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: Optional[Union[str, list[str]]]) -> Optional[list[str]]:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else list(value)
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=1)
    echo: Literal[False] = False
    best_of: Optional[Literal[1]] = None
    logprobs: Optional[Literal[0]] = None
    suffix: Optional[Literal[""]] = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> Union[str, list[int]]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("a batch of prompts is not supported: send one prompt per request")
            value = value[0]
        if isinstance(value, list) and not value:
            raise ValueError("must not be empty")
        if isinstance(value, str) and not value:
            raise ValueError("must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict[str, Any]]]
    name: Optional[str] = None

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
    logprobs: Literal[False] = False
    top_logprobs: Optional[Literal[0]] = None
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
