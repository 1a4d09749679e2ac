"""The OpenAI-compatible HTTP app (FastAPI) of ``accel serve``, on an :class:`accel.Engine`.

Endpoints:

- ``POST /v1/chat/completions`` -- ``messages`` through the tokenizer's chat template;
- ``POST /v1/completions`` -- a raw ``prompt`` (text or token ids);
- ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text format, :mod:`.metrics`).

Request bodies are in :mod:`.protocol`; a request's strategies (its ``accel`` field)
replace the server's. Responses carry ``usage`` and an ``accel`` field with the request's
stats (tokens per verify step, KV bytes kept and full). Streams are Server-Sent Events in
OpenAI's chunk shapes, ending with ``data: [DONE]``.

Every request is validated before it reaches the engine; a bad one gets an OpenAI-style
error body naming the field and the server keeps serving. Stop strings are matched on the
decoded text across token boundaries (:class:`accel.text.StopMatcher`): text that could be
the start of a stop string is held back until it is known not to be, and a matched request
is cancelled in the engine. A client that disconnects cancels its request.

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

from pydantic import ValidationError

from ..strategy import StrategyError, build_strategies
from ..text import StopMatcher, TextStream
from .metrics import SERVER_HELP, prometheus_text
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest, validation_error

try:
    import anyio
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _err:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"accel serve needs the 'serve' extra: pip install 'accel[serve]' ({_err})") from None

__all__ = ["create_app", "DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_TOKENS", "DEFAULT_MAX_PENDING"]

log = logging.getLogger(__name__)

#: Request bodies larger than this are refused with 413.
DEFAULT_MAX_BODY_BYTES = 1 << 20
#: ``max_tokens`` for a request that gives none (capped by what the context has left).
DEFAULT_MAX_TOKENS = 256
#: Requests admitted at once (running, waiting in the engine, or streaming); more get 503.
DEFAULT_MAX_PENDING = 256
_DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks for a gone client
_MAX_STOP = 4  # as OpenAI


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
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs in the answer
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the answer
    lps: list[Any] = field(default_factory=list)  # the generated tokens' TokenLogprob, as they come
    prompt_lps: list[Any] | None = None  # the prompt's (echo with logprobs), once the request ends
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
        self.counters: dict[str, Counter] = {name: Counter() for name in SERVER_HELP}

    def count(self, name: str, n: int = 1, **labels: Any) -> None:
        self.counters[name][tuple(sorted(labels.items()))] += n

    # ------------------------------------------------------------------ parsing

    async def read(self, request: Request, cls: type[SamplingRequest]) -> SamplingRequest:
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
            raise validation_error(err) from None

    def job(self, req: SamplingRequest) -> _Job:
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
        logprobs, echo = None, False
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise ApiError(400, "top_logprobs: needs logprobs set to true", "top_logprobs", "invalid_value")
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs, echo = req.logprobs, bool(req.echo)
            if echo and req.stream:
                raise ApiError(400, "echo: not supported with stream; send a non-streaming request", "echo",
                               "invalid_value")
            if max_tokens == 0 and not echo:
                raise ApiError(400, "max_tokens: 0 is allowed only with echo (to score the prompt)", "max_tokens",
                               "invalid_value")
        return _Job(
            logprobs=logprobs, echo=echo, kind=kind, prompt=prompt, max_tokens=max_tokens,
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
                top_p=job.top_p, seed=job.seed, strategies=job.strategies, logprobs=job.logprobs,
                prompt_logprobs=job.logprobs if job.echo and job.logprobs is not None else None,
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
                    if item.logprobs:
                        job.lps.extend(item.logprobs)
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
            job.prompt_lps = getattr(result, "prompt_logprobs", None)
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


async def _complete(srv: _Server, request: Request, cls: type[SamplingRequest]) -> Response:
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


def _token_texts(srv: _Server, tokens: list[int], lps: list[Any]) -> dict[int, str]:
    """The text of each of ``tokens`` and of the alternatives in ``lps`` (TokenLogprob or None),
    each decoded alone, in one tokenizer call."""
    ids = sorted({*tokens, *(j for t in lps if t is not None for j, _ in t.top)})
    if srv.tokenizer is None:
        return {i: f"token_id:{i}" for i in ids}  # as vLLM's return_tokens_as_token_ids
    with srv.tokenizer_lock:
        return dict(zip(ids, srv.tokenizer.batch_decode([[i] for i in ids])))


def _chat_logprobs(srv: _Server, lps: list[Any]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}``."""
    texts = _token_texts(srv, [t.token for t in lps], lps)

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": texts[token], "logprob": logprob, "bytes": list(texts[token].encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top]}
                        for t in lps], "refusal": None}


def _text_logprobs(srv: _Server, tokens: list[int], lps: list[Any]) -> dict[str, Any]:
    """The completions ``logprobs`` of ``tokens``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (token text -> log-probability) and ``text_offset`` (each token's character
    offset); ``lps[i]`` is token i's TokenLogprob, or None where nothing precedes it (null).
    """
    texts = _token_texts(srv, tokens, lps)
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for token, t in zip(tokens, lps):
        out["tokens"].append(texts[token])
        out["token_logprobs"].append(None if t is None else t.logprob)
        out["top_logprobs"].append(None if t is None else {texts[i]: v for i, v in t.top})
        out["text_offset"].append(offset)
        offset += len(texts[token])
    return out


def _prompt_text(srv: _Server, job: _Job) -> str:
    if srv.tokenizer is None:
        return ""
    with srv.tokenizer_lock:
        return srv.tokenizer.decode(job.prompt)


def _full_response(srv: _Server, job: _Job, text: str, outcome: _Outcome) -> dict[str, Any]:
    if job.kind == "chat":
        logprobs = _chat_logprobs(srv, job.lps) if job.logprobs is not None else None
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": outcome.finish_reason}
    else:
        logprobs = None
        if job.logprobs is not None:
            tokens, lps = [t.token for t in job.lps], list(job.lps)
            if job.echo:  # the prompt's first, the first token's null
                tokens, lps = job.prompt + tokens, list(job.prompt_lps or [None] * len(job.prompt)) + lps
            logprobs = _text_logprobs(srv, tokens, lps)
        if job.echo:
            text = _prompt_text(srv, job) + text
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": outcome.finish_reason}
    return {**_head(srv, job), "choices": [choice], "usage": _usage(job, outcome), "accel": _stats_dict(outcome.stats)}


def _event(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(srv: _Server, job: _Job, handle: Any) -> AsyncIterator[str]:
    head = _head(srv, job)
    head["object"] = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    extra = {"usage": None} if job.include_usage else {}

    sent = 0  # the generated tokens whose log-probabilities went out

    def chunk(text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        nonlocal sent
        logprobs = None
        if job.logprobs is not None and not first:  # each chunk carries the tokens decided since the last
            new, sent = job.lps[sent:], len(job.lps)
            logprobs = _chat_logprobs(srv, new) if job.kind == "chat" else _text_logprobs(srv, [t.token for t in new], new)
        if job.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
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
