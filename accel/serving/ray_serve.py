"""``accel serve --ray``: the OpenAI-compatible app of :mod:`.app` as Ray Serve replicas,
behind one endpoint that routes by prompt prefix.

Two tiers, because a router only sees what a handle call passes it (the proxy hands an HTTP
request's body to a replica lazily, after routing):

- :class:`Ingress` (one replica, light): takes every HTTP request, reads its body, cuts the
  prompt (chat messages or completion prompt) into a chain of block hashes
  (:func:`prefix_blocks`) and forwards the request to a model replica through a handle whose
  router is :class:`PrefixAffinityRouter`; it relays the replica's response, SSE streams
  included, and cancels the replica's call when its client goes away.
- :class:`ModelReplica` (``--replicas N`` or ``--autoscale MIN:MAX``): loads the model, runs
  an :class:`accel.Engine` and the same FastAPI app as ``accel serve`` (built by
  :func:`.app.create_app`), and runs each forwarded request through that app in process.
  Every response carries the replica's id in the ``x-accel-replica`` header; a request that
  sends that header is routed to that replica (e.g. ``GET /metrics`` of one replica).

:class:`PrefixAffinityRouter` sends a request to the replica that served the longest prefix
of its prompt (whole blocks of :data:`BLOCK_CHARS` characters; that replica's prefix store
likely holds the prompt's KV entries), unless that replica has more than ``max_imbalance``
requests more in flight than the least loaded one: then, as for prompts nothing matched, the
least loaded replica gets it (Ray Serve's probing of queue lengths, full replicas skipped).
"""

import asyncio
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator

from ..cluster import connect, import_ray

import_ray("accel serve --ray")  # without ray: an ImportError naming the extra
try:
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica
except ImportError as _err:  # ray without its serve part
    raise ImportError(f"accel serve --ray needs the 'ray' extra: pip install 'accel[ray]' ({_err})") from None

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from .app import DEFAULT_MAX_TOKENS
from .protocol import ApiError

__all__ = ["ReplicaSpec", "PrefixAffinityRouter", "ModelReplica", "Ingress", "build_app",
           "prefix_blocks", "prompt_text", "run_cli", "REPLICA_HEADER", "BLOCK_CHARS"]

log = logging.getLogger(__name__)

#: Response header naming the replica that answered; a request carrying it goes to that replica.
REPLICA_HEADER = "x-accel-replica"
#: Characters per prefix block: prompts are matched in whole blocks.
BLOCK_CHARS = 64
APP_NAME = "accel"


# --------------------------------------------------------------------------------------------
# Prefix keys
# --------------------------------------------------------------------------------------------


def prompt_text(path: str, body: bytes) -> str | None:
    """The prompt of a request body as one string (chat: roles and contents in order), or
    None when the body is not a prompt (the replica's app reports what is wrong with it)."""
    try:
        req = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(req, dict):
        return None
    if path.endswith("/chat/completions") and isinstance(req.get("messages"), list):
        parts = []
        for m in req["messages"]:
            if isinstance(m, dict):
                content = m.get("content")
                text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
                parts.append(f"{m.get('role')}\x1f{text}\x1e")
        return "".join(parts)
    if path.endswith("/completions"):
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return "".join(f"{t}," for t in prompt)
    return None


def prefix_blocks(text: str | None, block: int = BLOCK_CHARS) -> list[bytes]:
    """Chained hashes of ``text``'s whole blocks of ``block`` characters: entry i stands for the
    first ``(i + 1) * block`` characters, so two prompts share the first k entries exactly when
    (hash collisions aside) they share their first k blocks."""
    if not text:
        return []
    out, h = [], b""
    for i in range(0, len(text) - block + 1, block):
        h = hashlib.blake2b(h + text[i:i + block].encode("utf-8", "surrogatepass"), digest_size=12).digest()
        out.append(h)
    return out


# --------------------------------------------------------------------------------------------
# The router
# --------------------------------------------------------------------------------------------


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router of :class:`ModelReplica` handles (see the module docstring).

    Reads two keyword arguments of the handle call: ``prefix`` (:func:`prefix_blocks` of the
    prompt) and ``replica`` (the id of a replica to pin the request to; ignored if no such
    replica is running).
    """

    def initialize_state(self, max_imbalance: int = 4, blocks_per_replica: int = 1 << 16) -> None:
        self.max_imbalance = max_imbalance
        self.blocks_per_replica = blocks_per_replica
        self.blocks: dict[ReplicaID, OrderedDict[bytes, None]] = {}

    def matched(self, replica_id: ReplicaID, prefix: list[bytes]) -> int:
        """How many leading blocks of ``prefix`` the replica served recently."""
        seen = self.blocks.get(replica_id)
        if not seen:
            return 0
        n = 0
        for h in prefix:
            if h not in seen:
                break
            n += 1
        return n

    def load(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        pinned = [r for r in candidate_replicas if r.replica_id.unique_id == kwargs.get("replica")]
        if pinned:  # a replica that is gone is no pin: routed as any request (the header says where)
            return [pinned]
        prefix = kwargs.get("prefix") or []
        if prefix and candidate_replicas:
            scored = [(self.matched(r.replica_id, prefix), -self.load(r), r) for r in candidate_replicas]
            best_match, neg_load, best = max(scored, key=lambda s: (s[0], s[1]))
            least = min(self.load(r) for r in candidate_replicas)
            if best_match > 0 and -neg_load - least <= self.max_imbalance:
                return [[best], [r for r in candidate_replicas if r is not best]]
        # Serve takes the least loaded one with room; shuffled so that ties spread out
        return [random.sample(candidate_replicas, len(candidate_replicas))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        prefix = pending_request.kwargs.get("prefix") or []
        if not prefix:
            return
        seen = self.blocks.setdefault(replica_id, OrderedDict())
        for h in prefix:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.blocks_per_replica:
            seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.blocks.pop(replica_id, None)


# --------------------------------------------------------------------------------------------
# The model replicas
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaSpec:
    """What every model replica loads and serves (``accel serve`` flags)."""

    model: str = "default"
    strategies: tuple[str, ...] = ()
    max_batch: int = 8
    dtype: str = "float32"
    quantize: str | None = None
    prefix_cache_mb: float | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    model_name: str | None = None
    num_cpus: float = 1.0  # Ray resources per replica; torch threads = max(1, int(num_cpus))
    num_gpus: float = 0.0  # > 0: the model goes to "cuda"


class ModelReplica:
    """One model, one :class:`accel.Engine`, the FastAPI app of :mod:`.app` on them.

    ``loaded``: an already loaded ``(model, tokenizer)`` to serve instead of loading
    ``spec.model`` (tests pass a tiny random model this way).
    """

    def __init__(self, spec: ReplicaSpec, loaded: tuple[Any, Any] | None = None):
        import torch

        import accel
        from ..models import load_model
        from ..strategy import build_strategies
        from .app import create_app
        from .serve import served_name
        from .service import DEFAULT_PREFIX_CACHE_MB

        torch.set_num_threads(max(1, int(spec.num_cpus)))
        if loaded is None:
            model, tokenizer = load_model(spec.model, dtype=spec.dtype, quantize=spec.quantize,
                                          device="cuda" if spec.num_gpus > 0 else "cpu")
        else:
            model, tokenizer = loaded
        context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        name = spec.model_name or served_name(spec.model)
        prefix_mb = DEFAULT_PREFIX_CACHE_MB if spec.prefix_cache_mb is None else spec.prefix_cache_mb
        self.engine = accel.Engine(model, strategies=build_strategies(list(spec.strategies)),
                                   max_batch=spec.max_batch, tokenizer=tokenizer, prefix_cache_mb=prefix_mb)
        self.app = create_app(self.engine, tokenizer, model_id=name, context_length=context,
                              vocab_size=getattr(model.config, "vocab_size", None),
                              aliases=tuple({"default", spec.model} - {name}), default_max_tokens=spec.max_tokens)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, method: str, path: str, query: str, headers: list[tuple[str, str]], body: bytes,
                      prefix: list[bytes] | None = None, replica: str | None = None) -> AsyncIterator[Any]:
        """Run one HTTP request through the app: yields ``(status, headers)``, then body chunks.

        ``prefix`` and ``replica`` are for the router. If the caller stops reading (its
        client went away), the app sees a disconnect and cancels the request in the engine.
        """
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": query.encode(), "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
        }
        messages: asyncio.Queue[Any] = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await messages.put(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:
                    task.result()  # raises what the app raised
                    return
                if message["type"] == "http.response.start":
                    out = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                    yield message["status"], out + [(REPLICA_HEADER, self.replica_id)]
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    if not message.get("more_body", False):
                        return
        finally:
            if not task.done():
                gone.set()  # the app's disconnect path: cancels the engine request
                done, _ = await asyncio.wait({task}, timeout=5.0)
                if not done:
                    task.cancel()

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


# --------------------------------------------------------------------------------------------
# The ingress
# --------------------------------------------------------------------------------------------

_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive"}


async def _relay_stream(chunks: Any) -> AsyncIterator[bytes]:
    """The rest of a streamed response; a replica lost mid-stream ends it with an error event."""
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    except Exception as err:
        finished = True
        error = ApiError(503, f"the model replica failed: {type(err).__name__}: {_first_line(err)}", None,
                         "replica_unavailable", "server_error").body()
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        if not finished:  # the client went away: stop the replica's call
            chunks.cancel()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


ingress_app = FastAPI(title="accel (Ray Serve ingress)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """Forwards every request to a :class:`ModelReplica` picked by :class:`PrefixAffinityRouter`."""

    def __init__(self, model: Any):
        self.model = model.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def relay(self, path: str, request: Request) -> Response:
        body = await request.body()
        url_path = request.url.path
        prefix = prefix_blocks(prompt_text(url_path, body)) if request.method == "POST" else []
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_HEADERS]
        chunks = self.model.forward.remote(request.method, url_path, request.url.query, headers, body,
                                           prefix=prefix, replica=request.headers.get(REPLICA_HEADER))
        try:
            status, out = await chunks.__anext__()
        except Exception as err:  # the replica died or refused before answering
            chunks.cancel()
            log.warning("%s %s failed on its replica: %s", request.method, url_path, err)
            return ApiError(503, f"the model replica failed: {type(err).__name__}: {_first_line(err)}", None,
                            "replica_unavailable", "server_error").response()
        kept = {k: v for k, v in out if k.lower() not in _HOP_HEADERS}
        if kept.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(_relay_stream(chunks), status_code=status, headers=kept)
        try:
            data = b"".join([c async for c in chunks])
        except Exception as err:
            return ApiError(503, f"the model replica failed: {type(err).__name__}: {_first_line(err)}", None,
                            "replica_unavailable", "server_error").response()
        return Response(data, status_code=status, headers=kept)


# --------------------------------------------------------------------------------------------
# Building and running
# --------------------------------------------------------------------------------------------


def build_app(spec: ReplicaSpec, *, replicas: int = 1, autoscale: tuple[int, int] | None = None,
              loaded: tuple[Any, Any] | None = None, max_imbalance: int | None = None) -> Any:
    """The Ray Serve application: :class:`Ingress` over ``replicas`` :class:`ModelReplica`
    (or an autoscaled range), ready for ``serve.run``."""
    if spec.max_batch <= 0:
        raise ValueError(f"--max-batch must be > 0, got {spec.max_batch}")
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    if spec.num_cpus <= 0:
        raise ValueError(f"--replica-cpus must be > 0, got {spec.num_cpus}")
    scaling: dict[str, Any] = {"num_replicas": replicas}
    if autoscale is not None:
        low, high = autoscale
        if not 0 <= low <= high or high < 1:
            raise ValueError(f"--autoscale MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1, got {low}:{high}")
        scaling = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                          "target_ongoing_requests": max(1, spec.max_batch // 2)}}
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"max_imbalance": max(1, spec.max_batch // 2) if max_imbalance is None
                               else max_imbalance})
    actor: dict[str, Any] = {"num_cpus": spec.num_cpus}
    if spec.num_gpus > 0:
        actor["num_gpus"] = spec.num_gpus
    model = serve.deployment(ModelReplica, name="model", max_ongoing_requests=spec.max_batch,
                             ray_actor_options=actor, request_router_config=router, **scaling)
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0.1},
                               max_ongoing_requests=1024)
    return ingress.bind(model.bind(spec, loaded))


def _autoscale(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if not sep or not low.isdigit() or not high.isdigit():
        raise ValueError(f"--autoscale {text!r}: expected MIN:MAX, e.g. 1:4")
    return int(low), int(high)


def run_cli(args: Any) -> int:
    """``accel serve --ray`` (flags in :mod:`accel.cli`): deploy, then serve until interrupted."""
    from ..strategy import build_strategies

    build_strategies(args.strategy)  # validate before anything starts
    spec = ReplicaSpec(model=args.model, strategies=tuple(args.strategy), max_batch=args.max_batch, dtype=args.dtype,
                       quantize=getattr(args, "quantize", None), prefix_cache_mb=args.prefix_cache_mb,
                       max_tokens=DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens,
                       model_name=args.model_name, num_cpus=args.replica_cpus, num_gpus=args.replica_gpus)
    if spec.max_tokens <= 0:
        raise ValueError(f"--max-tokens must be > 0, got {spec.max_tokens}")
    if args.replicas is not None and args.autoscale is not None:
        raise ValueError("give --replicas or --autoscale, not both")
    app = build_app(spec, replicas=args.replicas or 1, autoscale=_autoscale(args.autoscale))
    connect(args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    print(f"accel serve --ray: {args.model} at http://{args.host}:{args.port}/v1 "
          f"({_replicas_text(args)}; Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)
    return 0


def _replicas_text(args: Any) -> str:
    return f"autoscaled {args.autoscale} replicas" if args.autoscale else f"{args.replicas} replica(s)"

