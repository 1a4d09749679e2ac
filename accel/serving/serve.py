"""``accel serve``: an OpenAI-compatible HTTP API (FastAPI + uvicorn) on an :class:`accel.Engine`.

Endpoints:

- ``POST /v1/chat/completions`` -- ``messages`` through the tokenizer's chat template;
- ``POST /v1/completions`` -- a raw ``prompt`` (text or token ids);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format).

Both completion endpoints take OpenAI's fields ``max_tokens``, ``temperature``, ``top_p``,
``stop``, ``seed``, ``stream`` (+ ``stream_options.include_usage``) and ``n=1``, plus two
extensions: ``top_k``, and ``accel``, that request's strategies (specs such as
``"snapkv:budget=256"`` or mappings with a ``name``), which replace the server's. Responses
carry ``usage`` and an ``accel`` field with the request's stats (tokens per verify step,
KV bytes kept and full). Streams are Server-Sent Events in OpenAI's chunk shapes, ending with
``data: [DONE]``.

Every request is validated before it reaches the engine; a bad one gets an OpenAI-style
error body naming the field (``{"error": {"message", "type", "param", "code"}}``) and the
server keeps serving. Stop strings are matched on the decoded text across token boundaries:
text that could be the start of a stop string is held back until it is known not to be, and
a matched request is cancelled in the engine. A client that disconnects cancels its request.

The engine's thread hands each request's deltas to the event loop
(:meth:`accel.serving.service.RequestHandle.on_delta`, ``call_soon_threadsafe`` into an
``asyncio.Queue``): no thread per request, and the loop itself never blocks on the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..strategy import StrategyError, build_strategies
from ..text import TextStream

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"accel serve needs the 'serve' extra: pip install 'accel[serve]' ({_err})") from None

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "StopMatcher",
    "create_app",
    "prometheus_text",
    "run_cli",
]

log = logging.getLogger("accel.serving.serve")

#: Request bodies larger than this are refused with 413.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: ``max_tokens`` for a request that gives none (capped by what the context has left).
DEFAULT_MAX_TOKENS = 256
#: Requests admitted at once (running, waiting in the engine, or streaming); more get 503.
DEFAULT_MAX_PENDING = 256
_DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks for a gone client
_MAX_STOP = 4  # as OpenAI


# --------------------------------------------------------------------------------------------
# Wire format
# --------------------------------------------------------------------------------------------


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


class _Sampling(_Wire):
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


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)  # OpenAI's newer name for max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]


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


def _validation_error(err: ValidationError) -> ApiError:
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


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


class StopMatcher:
    """Finds stop strings in text that arrives in pieces; emits only text before the first.

    ``feed(piece)`` returns ``(text_to_emit, matched)``. Text that could be the start of a
    stop string (a suffix of what was received that is a prefix of a stop string) is held
    back until the next piece decides it; :meth:`flush` releases it at the end.
    """

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.matched = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.matched:
            return "", True
        if not self.stops:
            return piece, False
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.matched, self.pending = True, ""
            return buf[: min(hits)], True
        hold = self._partial(buf)
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _partial(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest


# --------------------------------------------------------------------------------------------
# The engine bridge
# --------------------------------------------------------------------------------------------

_END = object()


class _Bridge:
    """Queues a handle's deltas for the event loop: the engine's thread hands each one over
    (:meth:`RequestHandle.on_delta`) with ``call_soon_threadsafe``, so no thread waits per
    request. A duck-typed handle without ``on_delta`` is read in a thread of its own."""

    def __init__(self, handle: Any, loop: asyncio.AbstractEventLoop):
        self.handle, self.loop = handle, loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        if hasattr(handle, "on_delta"):
            handle.on_delta(self._deliver)
        else:
            threading.Thread(target=self._pump, name="accel-serve-stream", daemon=True).start()

    def _deliver(self, delta: Any) -> None:
        self._put(_END if delta is None else delta)

    def _pump(self) -> None:
        try:
            for delta in self.handle.stream():
                self._put(delta)
        except BaseException as err:  # handed to the request, which reports it
            self._put(err)
        finally:
            self._put(_END)

    def _put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            pass


class _ClientGone(Exception):
    pass


@dataclass
class _Job:
    """One validated request, ready for the engine."""

    kind: Literal["chat", "text"]
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int | None
    seed: int | None
    stops: list[str]
    strategies: list[Any] | None
    stream: bool
    include_usage: bool
    done: bool = False  # the engine finished it and its outcome is known
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class _Outcome:
    finish_reason: str
    completion_tokens: int
    stats: Any


def _strategy_message(message: str) -> str:
    """``build_strategies``' message with the request's field name: ``strategies[0].x`` -> ``accel[0].x``."""
    message = re.sub(r"^strategies\[(\d+)\]\.(?=unknown strategy|strategy mapping)", r"accel[\1]: ", message)
    return re.sub(r"^strategies\[", "accel[", message)


_ENGINE_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
                  "top_k": "top_k", "seed": "seed", "strateg": "accel", "prompt": "prompt"}


def _engine_param(message: str) -> str | None:
    for word, param in _ENGINE_FIELDS.items():
        if word in message:
            return param
    return None


def _stats_dict(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    out = dict(stats.as_dict()) if hasattr(stats, "as_dict") else {}
    for name in ("mean_accepted", "kv_bytes_kept", "kv_bytes_full"):
        if hasattr(stats, name):
            out[name] = getattr(stats, name)
    return {k: v for k, v in out.items() if isinstance(v, (int, float, str, bool)) or v is None}


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

# engine.metrics() key -> (Prometheus name, type, help)
_ENGINE_METRICS = {
    "requests_total": ("accel_requests_total", "counter", "Requests the engine has admitted."),
    "requests_running": ("accel_requests_running", "gauge", "Requests decoding now."),
    "requests_waiting": ("accel_requests_waiting", "gauge", "Requests waiting for a batch row."),
    "tokens_generated": ("accel_tokens_generated_total", "counter", "Tokens the engine has emitted."),
    "verify_steps": ("accel_verify_steps_total", "counter", "Verify forward passes."),
    "mean_accepted": ("accel_mean_accepted_tokens", "gauge", "Tokens emitted per verify step, bonus token included."),
    "batch_occupancy": ("accel_batch_occupancy", "gauge", "Live rows per verify step over max_batch."),
    "kv_bytes": ("accel_kv_bytes", "gauge", "Bytes held by the shared KV cache now."),
    "accepted_tokens": ("accel_accepted_draft_tokens_total", "counter", "Draft tokens accepted (bonus tokens excluded)."),
    "batch_rows_stepped": ("accel_batch_rows_stepped_total", "counter", "Rows summed over verify steps."),
    "max_batch": ("accel_max_batch", "gauge", "Rows the engine decodes together at most."),
    "prefills": ("accel_prefills_total", "counter", "Prefill forwards admitting waiting requests."),
    "prefill_seconds": ("accel_prefill_seconds_total", "counter", "Seconds the engine spent admitting requests."),
    "step_seconds": ("accel_step_seconds_total", "counter", "Seconds the engine spent in verify steps."),
    "prefix_hits": ("accel_prefix_hits_total", "counter", "Prompts that reused an earlier prompt's entries."),
    "prefix_tokens_reused": ("accel_prefix_tokens_reused_total", "counter",
                             "Prompt tokens not prefilled: their entries came from an earlier prompt."),
    "prefix_cache_bytes": ("accel_prefix_cache_bytes", "gauge", "Bytes of prompt entries kept for reuse."),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(engine_metrics: dict[str, Any], server: dict[str, Counter]) -> str:
    """The Prometheus text exposition of the engine's metrics and the server's counters.

    server: metric name -> Counter of label tuples ``((label, value), ...)`` -> count.
    """
    lines: list[str] = []
    for key, value in engine_metrics.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        name, kind, help_ = _ENGINE_METRICS.get(key, (f"accel_{key}", "gauge", f"engine metric {key}"))
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {float(value):g}"]
    for name, counts in server.items():
        help_ = _SERVER_HELP.get(name, name)
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
        if not counts and name in _UNLABELLED:
            lines.append(f"{name} 0")
        for labels, count in sorted(counts.items()):
            text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels)
            lines.append(f"{name}{{{text}}} {count}" if text else f"{name} {count}")
    return "\n".join(lines) + "\n"


_UNLABELLED = {"accel_http_prompt_tokens_total", "accel_http_completion_tokens_total", "accel_http_cancelled_total"}
_SERVER_HELP = {
    "accel_http_requests_total": "HTTP requests answered, by path and status code.",
    "accel_http_finished_total": "Completions finished, by finish reason.",
    "accel_http_prompt_tokens_total": "Prompt tokens of completed requests.",
    "accel_http_completion_tokens_total": "Completion tokens sent to clients.",
    "accel_http_cancelled_total": "Requests the server cancelled unfinished: the client went away, or generation failed.",
}


# --------------------------------------------------------------------------------------------
# The app
# --------------------------------------------------------------------------------------------


class _Server:
    def __init__(self, engine: Any, tokenizer: Any, model_id: str, context_length: int, vocab_size: int | None,
                 aliases: tuple[str, ...], default_max_tokens: int, max_body_bytes: int, max_pending: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_id, self.names = model_id, {model_id, *aliases}
        self.context_length, self.vocab_size = context_length, vocab_size
        self.default_max_tokens, self.max_body_bytes, self.max_pending = default_max_tokens, max_body_bytes, max_pending
        self.pending = 0
        self.tokenizer_lock = threading.Lock()  # encoding from several request threads at once
        self.created = int(time.time())
        self.counters: dict[str, Counter] = {name: Counter() for name in _SERVER_HELP}

    def count(self, name: str, n: int = 1, **labels: Any) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += n

    # ------------------------------------------------------------------ parsing

    async def read(self, request: Request, cls: type[_Sampling]) -> _Sampling:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise ApiError(413, f"request body is larger than {self.max_body_bytes} bytes", None, "request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise ApiError(413, f"request body is larger than {self.max_body_bytes} bytes", None,
                               "request_too_large")
        if not body.strip():
            raise ApiError(400, "the request body is empty; send a JSON object", None, "invalid_json")
        try:
            return cls.model_validate_json(bytes(body))
        except ValidationError as err:
            raise _validation_error(err) from None

    def job(self, req: _Sampling) -> _Job:
        """Check what pydantic cannot and turn the request into token ids (runs in a thread)."""
        if req.model is not None and req.model not in self.names:
            raise ApiError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_id}'",
                           "model", "model_not_found")
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > _MAX_STOP:
            raise ApiError(400, f"stop: at most {_MAX_STOP} stop strings", "stop", "invalid_value")
        if any(not s for s in stops):
            raise ApiError(400, "stop: stop strings must not be empty", "stop", "invalid_value")
        strategies = None
        if req.accel is not None:
            try:
                strategies = build_strategies(req.accel)
            except StrategyError as err:
                raise ApiError(400, _strategy_message(str(err)), "accel", "invalid_strategy") from None

        if isinstance(req, ChatCompletionRequest):
            kind, where, prompt = "chat", "messages", self.chat_prompt(req)
            max_tokens, max_name = req.max_completion_tokens, "max_completion_tokens"
            if max_tokens is None:
                max_tokens, max_name = req.max_tokens, "max_tokens"
        else:
            kind, where, prompt = "text", "prompt", self.text_prompt(req)
            max_tokens, max_name = req.max_tokens, "max_tokens"
        if not prompt:
            raise ApiError(400, f"{where}: the prompt has no tokens", where, "invalid_value")
        room = self.context_length - len(prompt)
        if room <= 0:
            raise ApiError(400, f"{where}: the prompt has {len(prompt)} tokens; this model's context holds "
                           f"{self.context_length}", where, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise ApiError(400, f"{max_name}: the prompt ({len(prompt)} tokens) plus {max_name} ({max_tokens}) "
                           f"exceed this model's context of {self.context_length} tokens", max_name,
                           "context_length_exceeded")
        return _Job(
            kind=kind, prompt=prompt, max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=req.top_p if req.top_p is not None and req.top_p < 1.0 else None, top_k=req.top_k or None,
            seed=req.seed, stops=stops, strategies=strategies, stream=bool(req.stream),
            include_usage=bool(req.stream and req.stream_options and req.stream_options.include_usage),
        )

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        from ..models import chat_ids

        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages",
                           "no_chat_template")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            with self.tokenizer_lock:
                return chat_ids(self.tokenizer, messages)[0].tolist()
        except Exception as err:  # a template may refuse a conversation (e.g. roles out of order)
            raise ApiError(400, f"messages: the chat template refused them ({err})", "messages", "invalid_value") from None

    def text_prompt(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "prompt: batched prompts are not supported; send one prompt per request",
                               "prompt", "invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ApiError(400, "prompt: this server has no tokenizer; send token ids", "prompt", "invalid_value")
            with self.tokenizer_lock:
                return list(self.tokenizer(prompt).input_ids)
        bad = [t for t in prompt if t < 0 or (self.vocab_size is not None and t >= self.vocab_size)]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
                           if self.vocab_size else f"prompt: token id {bad[0]} is negative", "prompt", "invalid_value")
        return list(prompt)

    # ------------------------------------------------------------------ running

    def submit(self, job: _Job) -> Any:
        try:
            return self.engine.submit(
                job.prompt, max_new_tokens=job.max_tokens, temperature=job.temperature, top_k=job.top_k,
                top_p=job.top_p, seed=job.seed, strategies=job.strategies,
            )
        except StrategyError as err:
            raise ApiError(400, _strategy_message(str(err)), "accel", "invalid_strategy") from None
        except ValueError as err:
            # The sampling fields and the prompt were checked already: what the engine still
            # refuses is most likely a strategy that does not fit the model (e.g. Medusa heads).
            param = _engine_param(str(err)) or ("accel" if job.strategies is not None else None)
            if param == "accel":
                raise ApiError(400, f"accel: {err}", param, "invalid_strategy") from None
            raise ApiError(400, str(err), param, "invalid_value") from None
        except RuntimeError as err:  # a closed engine
            raise ApiError(503, f"the engine is not running: {err}", None, "engine_unavailable", "server_error") from None

    async def pieces(self, job: _Job, handle: Any, request: Request | None) -> AsyncIterator[str | _Outcome]:
        """Text pieces of one request as they are decided, then its :class:`_Outcome`.

        ``request`` (non-streaming only) is polled for a client that went away; a streaming
        response learns it from Starlette, which cancels this generator. However it ends
        early, the request is cancelled in the engine.
        """
        bridge = _Bridge(handle, asyncio.get_running_loop())
        matcher = StopMatcher(job.stops)
        decoder = TextStream(self.tokenizer) if self.tokenizer is not None else None  # for engines without text
        tokens, finish = 0, None
        loop = asyncio.get_running_loop()
        next_check = loop.time() + _DISCONNECT_POLL_S
        try:
            while True:
                if request is not None and loop.time() >= next_check:  # deltas may never pause
                    if await request.is_disconnected():
                        raise _ClientGone()
                    next_check = loop.time() + _DISCONNECT_POLL_S
                if request is None:
                    item = await bridge.queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(bridge.queue.get(), max(0.0, next_check - loop.time()))
                    except asyncio.TimeoutError:
                        continue
                if item is _END:
                    break
                if isinstance(item, BaseException):
                    raise item
                if finish is None:
                    tokens += len(item.tokens)
                    text = item.text
                    if text is None and decoder is not None:
                        text = decoder.push(list(item.tokens), final=item.finished)
                    out, matched = matcher.feed(text or "")
                    if out:
                        yield out
                    if matched:
                        finish = "stop"
                        handle.cancel()  # its stream ends with 'cancelled', drained below
                if item.finished:
                    if finish is None:
                        rest = matcher.flush()
                        if rest:
                            yield rest
                        finish = item.finish_reason or "stop"
                    break
            result = await anyio.to_thread.run_sync(lambda: handle.result(timeout=30))
            job.done = True
            if finish is None or finish == "error":
                raise RuntimeError(getattr(result, "error", None) or "the engine failed on this request")
            self.count("accel_http_finished_total", finish_reason=finish)
            self.count("accel_http_prompt_tokens_total", len(job.prompt))
            self.count("accel_http_completion_tokens_total", tokens)
            yield _Outcome(finish_reason=finish, completion_tokens=tokens, stats=getattr(result, "stats", None))
        finally:
            self.release(job, handle)

    def release(self, job: _Job, handle: Any) -> None:
        """Cancel an unfinished request (its client went away or it failed); idempotent."""
        if not job.done:
            job.done = True
            self.count("accel_http_cancelled_total")
            handle.cancel()


class _EventStream(StreamingResponse):
    """An SSE response that cancels its request however the response ends."""

    def __init__(self, events: AsyncIterator[str], on_close: Any):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class _CountRequests:
    """ASGI middleware: count answered requests by route and status code."""

    def __init__(self, app: Any, server: "_Server"):
        self.app, self.server = app, server

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 0

        async def send_counting(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            route = scope.get("route")
            self.server.count("accel_http_requests_total", path=getattr(route, "path", "other"), code=status)


def create_app(
    engine: Any,
    tokenizer: Any,
    *,
    model_id: str,
    context_length: int,
    vocab_size: int | None = None,
    aliases: tuple[str, ...] = (),
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_pending: int = DEFAULT_MAX_PENDING,
) -> FastAPI:
    """The FastAPI app serving ``engine`` (an :class:`accel.Engine`) under the name ``model_id``.

    context_length: the model's ``max_position_embeddings``: prompt + ``max_tokens`` must fit.
    vocab_size: token ids of a ``prompt`` given as ids must be below it.
    aliases: other names the ``model`` field may give (e.g. ``"default"``).
    The app does not own the engine: whoever made it closes it.
    """
    srv = _Server(engine, tokenizer, model_id, context_length, vocab_size, aliases, default_max_tokens,
                  max_body_bytes, max_pending)
    app = FastAPI(title="accel", version=_version(), docs_url="/docs", redoc_url=None)
    app.state.server = srv

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, err: ApiError) -> JSONResponse:
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return ApiError(err.status_code, str(err.detail), None, code).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return ApiError(400, str(err), None, "invalid_value").response()

    app.add_middleware(_CountRequests, server=srv)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = getattr(srv.engine, "alive", True)
        return JSONResponse({"status": "ok" if alive else "unavailable", "model": srv.model_id},
                            status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(srv)]}

    @app.get("/v1/models/{model}")
    async def model(model: str) -> dict[str, Any]:
        if model not in srv.names:
            raise ApiError(404, f"The model '{model}' does not exist", "model", "model_not_found")
        return _model_card(srv)

    @app.get("/metrics")
    async def metrics() -> Response:
        engine_metrics = await anyio.to_thread.run_sync(srv.engine.metrics)
        return PlainTextResponse(prometheus_text(engine_metrics, srv.counters),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(srv, request, ChatCompletionRequest)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(srv, request, CompletionRequest)

    return app


def _model_card(srv: _Server) -> dict[str, Any]:
    return {"id": srv.model_id, "object": "model", "created": srv.created, "owned_by": "accel",
            "max_model_len": srv.context_length}


def _version() -> str:
    from .. import __version__

    return __version__


async def _complete(srv: _Server, request: Request, cls: type[_Sampling]) -> Response:
    req = await srv.read(request, cls)
    job = await anyio.to_thread.run_sync(srv.job, req)  # tokenizing may take a while
    if srv.pending >= srv.max_pending:
        raise ApiError(503, f"the server is busy ({srv.pending} requests in flight); retry later", None,
                       "server_busy", "server_error")
    srv.pending += 1
    try:
        handle = await anyio.to_thread.run_sync(srv.submit, job)
    except BaseException:
        srv.pending -= 1
        raise
    if job.stream:

        def close() -> None:
            srv.pending -= 1
            srv.release(job, handle)

        return _EventStream(_sse(srv, job, handle), on_close=close)
    try:
        parts: list[str] = []
        outcome: _Outcome | None = None
        try:
            async for piece in srv.pieces(job, handle, request):
                if isinstance(piece, _Outcome):
                    outcome = piece
                else:
                    parts.append(piece)
        except _ClientGone:
            return Response(status_code=499)  # nobody reads it
        except Exception as err:
            log.exception("request %s failed", job.id)
            raise ApiError(500, f"generation failed: {err}", None, "engine_error", "server_error") from None
        assert outcome is not None
        return JSONResponse(_full_response(srv, job, "".join(parts), outcome))
    finally:
        srv.pending -= 1
        srv.release(job, handle)


def _usage(job: _Job, outcome: _Outcome) -> dict[str, Any]:
    n = len(job.prompt)
    cached = int(getattr(outcome.stats, "cached_prompt_tokens", 0) or 0)
    return {"prompt_tokens": n, "completion_tokens": outcome.completion_tokens,
            "total_tokens": n + outcome.completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}


def _head(srv: _Server, job: _Job) -> dict[str, Any]:
    if job.kind == "chat":
        return {"id": f"chatcmpl-{job.id}", "object": "chat.completion", "created": job.created, "model": srv.model_id}
    return {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created, "model": srv.model_id}


def _full_response(srv: _Server, job: _Job, text: str, outcome: _Outcome) -> dict[str, Any]:
    if job.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": outcome.finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": outcome.finish_reason}
    return {**_head(srv, job), "choices": [choice], "usage": _usage(job, outcome), "accel": _stats_dict(outcome.stats)}


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(srv: _Server, job: _Job, handle: Any) -> AsyncIterator[str]:
    head = _head(srv, job)
    head["object"] = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    extra = {"usage": None} if job.include_usage else {}

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if job.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [choice], **extra}

    try:
        if job.kind == "chat":
            yield _event(chunk(None, None, first=True))
        async for piece in srv.pieces(job, handle, None):
            if isinstance(piece, _Outcome):
                yield _event({**chunk(None, piece.finish_reason), "accel": _stats_dict(piece.stats)})
                if job.include_usage:
                    yield _event({**head, "choices": [], "usage": _usage(job, piece)})
            else:
                yield _event(chunk(piece, None))
        yield "data: [DONE]\n\n"
    except Exception as err:  # the response has started: report in the stream
        log.exception("request %s failed", job.id)
        yield _event(ApiError(500, f"generation failed: {err}", None, "engine_error", "server_error").body())
        yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def _served_name(spec: str) -> str:
    from pathlib import Path

    from ..models import DEFAULT_MODEL_NAME

    if spec == "default":
        return DEFAULT_MODEL_NAME
    path = Path(spec)
    return path.stem if path.suffix.lower() == ".gguf" else (path.name if path.exists() else spec)


def run_cli(args: Any) -> int:
    """``accel serve`` (flags in :mod:`accel.cli`): load the model, start an Engine, serve until interrupted."""
    import torch
    import uvicorn

    import accel
    from ..models import load_model

    strategies = build_strategies(args.strategy)  # validate before loading the model
    if args.max_batch <= 0:
        raise ValueError(f"--max-batch must be > 0, got {args.max_batch}")
    max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens must be > 0, got {max_tokens}")
    from .service import DEFAULT_PREFIX_CACHE_MB

    prefix_mb = DEFAULT_PREFIX_CACHE_MB if args.prefix_cache_mb is None else args.prefix_cache_mb
    if not 0 <= prefix_mb < float("inf"):
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {prefix_mb}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, quantize=getattr(args, "quantize", None))
    if tokenizer is None:
        log.warning("%s has no tokenizer: only /v1/completions with token ids will work", args.model)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context <= 0:
        raise ValueError(f"{args.model}: its config has no max_position_embeddings")
    name = args.model_name or _served_name(args.model)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server has no authentication", args.host)
    with accel.Engine(model, strategies=strategies, max_batch=args.max_batch, tokenizer=tokenizer,
                      prefix_cache_mb=prefix_mb) as engine:
        app = create_app(engine, tokenizer, model_id=name, context_length=context,
                         vocab_size=getattr(model.config, "vocab_size", None),
                         aliases=tuple({"default", args.model} - {name}), default_max_tokens=max_tokens)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
