"""The OpenAI wire format of ``accel serve``: request bodies and error bodies.

Both completion requests take OpenAI's fields ``max_tokens``, ``temperature``, ``top_p``,
``stop``, ``seed``, ``stream`` (+ ``stream_options.include_usage``) and ``n=1``; completions
also ``logprobs`` (0..20 alternatives) and ``echo`` (with ``max_tokens=0`` to score a prompt),
chat ``logprobs`` and ``top_logprobs``; plus two
extensions: ``top_k``, and ``accel``, that request's strategies (specs such as
``"snapkv:budget=256"`` or mappings with a ``name``). The models are strict (no silent
str -> number coercion, unknown fields refused). A request the server refuses is an
:class:`ApiError`, rendered as OpenAI's error body naming the field
(``{"error": {"message", "type", "param", "code"}}``); :func:`validation_error` turns
pydantic's first error into one.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..logprobs import MAX_TOP_LOGPROBS

try:
    from fastapi.responses import JSONResponse
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"accel serve needs the 'serve' extra: pip install 'accel[serve]' ({_err})") from None

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "SamplingRequest",
    "StreamOptions",
    "TextPart",
    "validation_error",
]


class _Wire(BaseModel):
    # strict: no silent str -> number coercion; JSON ints are still accepted for floats
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Wire):
    include_usage: bool = False


class TextPart(_Wire):
    type: Literal["text"]
    text: str


class ChatMessage(_Wire):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


StrategySpecs = list[str | dict[str, Any]] | str | dict[str, Any]


class SamplingRequest(_Wire):
    # null is the field's default, as many OpenAI clients send it for fields left unset
    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)  # extension (as vLLM); 0 or None: off
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    user: str | None = None
    accel: StrategySpecs | None = None  # extension: this request's strategies


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # needs logprobs true


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # alternatives per token
    echo: bool | None = None  # the prompt (and with logprobs its log-probabilities) before the text


_FIELD_NAMES = {
    name
    for cls in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in cls.model_fields
}


class ApiError(Exception):
    """A request the server refuses: rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _param(loc: tuple[Any, ...], unknown: bool = False) -> str | None:
    """pydantic's error location as a request path, e.g. ``messages[0].content``.

    unknown: the last part is a field the client made up (kept though it is no known name).
    """
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES or (unknown and i == len(loc) - 1):  # drops union tags such as 'list[int]'
            out += f".{part}" if out else str(part)
    return out or None


def validation_error(err: ValidationError) -> ApiError:
    first = err.errors(include_url=False)[0]
    kind, loc, msg = first["type"], tuple(first["loc"]), first["msg"]
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', msg)}", None, "invalid_json")
    if kind == "model_type" and not loc:
        return ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    param = _param(loc, unknown=kind == "extra_forbidden")
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'", param, "missing_required_parameter")
    return ApiError(400, f"{param}: {msg}" if param else msg, param, "invalid_value")
