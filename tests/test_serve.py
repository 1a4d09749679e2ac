"""``accel serve``: the real uvicorn server on a free localhost port, a tiny random Llama and a
tiny offline tokenizer; the official ``openai`` client and ``httpx`` against it."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

import accel  # noqa: E402
from accel.models import chat_ids  # noqa: E402
from accel.serving.serve import create_app  # noqa: E402
from accel.text import StopMatcher  # noqa: E402
from helpers import engine_held, make_tiny_model, make_tiny_tokenizer  # noqa: E402

MODEL_ID = "tiny-llama"
CONTEXT = 4096  # long enough that a request outlives its impatient client
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def server():
    """The app on a real uvicorn server in a thread, bound to 127.0.0.1 on a free port."""
    model, tokenizer = make_tiny_model(max_position_embeddings=CONTEXT), make_tiny_tokenizer()
    engine = accel.Engine(model, strategies=[], max_batch=8, tokenizer=tokenizer)
    app = create_app(engine, tokenizer, model_id=MODEL_ID, context_length=model.config.max_position_embeddings,
                     vocab_size=model.config.vocab_size, default_max_tokens=16)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        # References come from a second copy of the same weights, so that the test thread and
        # the engine's loop thread never share a module.
        yield SimpleNamespace(url=f"http://127.0.0.1:{port}", engine=engine, tokenizer=tokenizer,
                              reference_model=make_tiny_model(max_position_embeddings=CONTEXT))
    finally:
        uv.should_exit = True
        thread.join(20)
        engine.close()
        sock.close()


def reference(server, ids, max_new_tokens, strategies=()):
    """Greedy ``accel.generate`` on the same prompt: (text, number of new tokens)."""
    result = accel.generate(server.reference_model, ids, strategies=list(strategies), max_new_tokens=max_new_tokens,
                            tokenizer=server.tokenizer)
    return result.text[0], result.sequences.shape[1] - len(ids if isinstance(ids, list) else ids[0])


def chat_reference(server, content, max_new_tokens, strategies=()):
    ids = chat_ids(server.tokenizer, [{"role": "user", "content": content}])
    text, n = reference(server, ids, max_new_tokens, strategies)
    return text, n, ids.shape[1]


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30.0) as c:
        yield c


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        yield c


def sse_events(lines):
    """The JSON payloads of an SSE stream's ``data:`` lines; stops at ``[DONE]``."""
    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return events, True
        events.append(json.loads(data))
    return events, False


# ------------------------------------------------------------------------------ the happy paths


def test_health_and_models(client, http):
    assert http.get("/health").json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    assert http.get(f"/v1/models/{MODEL_ID}").json()["max_model_len"] == CONTEXT


def test_chat_non_streaming_equals_generate(server, client):
    text, n, prompt_tokens = chat_reference(server, "hello world", 20)
    out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello world"}],
                                         max_tokens=20, temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text
    assert out.choices[0].finish_reason == ("length" if n == 20 else "stop")
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == n
    assert out.usage.total_tokens == prompt_tokens + n
    stats = out.model_extra["accel"]
    assert stats["mean_accepted"] == pytest.approx(1.0)  # plain decoding: one token per step
    assert stats["kv_bytes_kept"] > 0 and stats["kv_bytes_full"] >= stats["kv_bytes_kept"]


def test_a_repeated_prompt_reuses_its_entries_and_gets_the_same_answer(server, client):
    content = "hello world " * 6
    text, n, prompt_tokens = chat_reference(server, content, 12)
    assert prompt_tokens > 8  # long enough to be kept (PrefixStore.min_tokens)
    for _ in range(2):
        out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": content}],
                                             max_tokens=12, temperature=0)
        assert out.choices[0].message.content == text
    assert out.usage.prompt_tokens_details.cached_tokens == prompt_tokens - 1  # all but the last prompt token


def test_chat_streaming_equals_generate(server, client):
    text, n, prompt_tokens = chat_reference(server, "what is the sun", 24)
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "what is the sun"}], max_tokens=24, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == ("length" if n == 24 else "stop")
    assert finals[0].model_extra["accel"]["mean_accepted"] == pytest.approx(1.0)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert chunks[-1].usage.prompt_tokens == prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_multi_turn_chat_uses_the_template(server, http):
    messages = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": "yes"}, {"role": "developer", "content": "be small"},
                {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "red"}]}]
    flat = [{"role": "system" if m["role"] == "developer" else m["role"],
             "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
            for m in messages]
    ids = chat_ids(server.tokenizer, flat)
    text, n = reference(server, ids, 12)
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text
    assert r.json()["usage"]["prompt_tokens"] == ids.shape[1]


def test_completions_text_ids_and_stream(server, client, http):
    prompt = "the big dog and the small cat"
    ids = server.tokenizer(prompt).input_ids
    text, n = reference(server, ids, 16)
    out = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == n

    by_ids = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 16, "temperature": 0}).json()
    assert by_ids["choices"][0]["text"] == text

    with http.stream("POST", "/v1/completions",
                     json={"prompt": [prompt], "max_tokens": 16, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, done = sse_events(r.iter_lines())
    assert done and all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == text
    assert "usage" not in events[-1] and events[-1]["choices"][0]["finish_reason"] is not None


def test_default_max_tokens_and_seeded_sampling(server, http):
    r = http.post("/v1/completions", json={"prompt": "hello"}).json()
    assert r["usage"]["completion_tokens"] <= 16  # the app's default_max_tokens
    body = {"prompt": "hello world", "max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": 7}
    first = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == first


def test_per_request_strategies(server, http):
    prompt = "one two three four one two three four one two three four one two"
    ids = server.tokenizer(prompt).input_ids
    plain, _ = reference(server, ids, 16)
    # A drafter leaves greedy output as it is; a compressor changes the cache, so the output
    # is what accel.generate gives with the same compressor.
    lookup = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                                "accel": ["prompt_lookup:num_tokens=4"]}).json()
    assert lookup["choices"][0]["text"] == plain
    assert lookup["accel"]["mean_accepted"] >= 1.0
    spec = {"name": "snapkv", "budget": 8, "window": 4}
    compressed, _ = reference(server, ids, 16, strategies=[spec])
    snap = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                              "accel": [spec]}).json()
    assert snap["choices"][0]["text"] == compressed
    assert snap["accel"]["kv_bytes_kept"] < snap["accel"]["kv_bytes_full"]


def test_openai_client_passes_strategies_and_nulls(server, client, http):
    text, _, _ = chat_reference(server, "hello world", 10)
    out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello world"}],
                                         max_tokens=10, temperature=0,
                                         extra_body={"accel": [{"name": "prompt_lookup", "num_tokens": 4}]})
    assert out.choices[0].message.content == text and out.model_extra["accel"]["mean_accepted"] >= 1.0
    # Clients that send null for unset fields get the defaults.
    body = {"prompt": "hello world", "max_tokens": 10, "temperature": 0, "top_p": None, "n": None, "stop": None,
            "stream": None, "seed": None, "accel": None}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_stop_strings_across_token_boundaries(server, http, client):
    text, _, _ = chat_reference(server, "a big red dog", 24)
    words = text.split(" ")
    assert len(words) >= 4
    # The end of the second word, the space and the start of the third: three tokens' text.
    stop = words[1][-1:] + " " + words[2][:2]
    cut = text[: text.find(stop)]
    body = {"messages": [{"role": "user", "content": "a big red dog"}], "max_tokens": 24, "temperature": 0,
            "stop": ["zzz", stop]}
    out = http.post("/v1/chat/completions", json=body).json()
    assert out["choices"][0]["message"]["content"] == cut
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < 24

    stream = client.chat.completions.create(model=MODEL_ID, stream=True, **body)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"

    # A stop string that never occurs: everything held back is released at the end.
    out = http.post("/v1/chat/completions", json={**body, "stop": text + " never"}).json()
    assert out["choices"][0]["message"]["content"] == text


# ------------------------------------------------------------------------------ bad input

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
LONG = list(range(6, 96)) * 46  # 4140 token ids: longer than the context


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/v1/chat/completions", b'{"messages": [', 400, None, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 400, None, "invalid_json"),
        ("/v1/chat/completions", b"", 400, None, "invalid_json"),
        ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", "missing_required_parameter"),
        ("/v1/chat/completions", {**CHAT, "frequency_penalty": 1}, 400, "frequency_penalty", "unknown_parameter"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400,
         "messages[0].x", "unknown_parameter"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role",
         "invalid_value"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "accel": ["warp_drive:speed=9"]}, 400, "accel", "invalid_strategy"),
        ("/v1/chat/completions", {**CHAT, "accel": [{"name": "snapkv", "budget": -3}]}, 400, "accel",
         "invalid_strategy"),
        ("/v1/chat/completions", {**CHAT, "accel": ["snapkv:bugdet=64"]}, 400, "accel", "invalid_strategy"),
        ("/v1/chat/completions", {**CHAT, "accel": ["medusa"]}, 400, "accel", "invalid_strategy"),  # heads of another model
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens",
         "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 10_000}, 400, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "temperature": 3}, 400, "temperature", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "n": 2}, 400, "n", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "seed": 2**70}, 400, "seed", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "accel": [{"name": "snapkv", "budget": 4, "window": 8}]}, 400, "accel",
         "invalid_strategy"),
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "stop": [""]}, 400, "stop", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options",
         "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "model": "gpt-4"}, 404, "model", "model_not_found"),
        ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
        ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 4}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"prompt": [3, 97], "max_tokens": 4}, 400, "prompt", "invalid_value"),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": LONG[:CONTEXT - 10], "max_tokens": 20}, 400, "max_tokens",
         "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of", "unknown_parameter"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, 400, "echo", "invalid_value"),
        ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400, "logprobs", "invalid_value"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "invalid_value"),
        ("/v1/completions", {"prompt": "hi", "logprobs": True}, 400, "logprobs", "invalid_value"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs",
         "invalid_value"),
        ("/v1/completions", b'{"prompt": "' + b"a " * (1 << 20) + b'"}', 413, None, "request_too_large"),
    ],
)
def test_bad_input_gets_an_openai_error(http, path, body, status, param, code):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == code, error
    assert error["type"] == "invalid_request_error" and error["message"]
    if param:
        assert param.split("[")[0].split(".")[0] in error["message"]


def test_server_keeps_serving_after_bad_input(http, client):
    for _ in range(3):
        assert http.post("/v1/chat/completions", content=b"{nope").status_code == 400
        assert http.post("/v1/completions", json={"prompt": "hi", "accel": ["nope"]}).status_code == 400
    assert http.get("/nowhere").json()["error"]["code"] == "not_found"
    out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.choices[0].finish_reason in ("length", "stop")


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert info.value.param == "max_tokens"


def test_oversized_body_without_content_length(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a " * 32768
        yield b'"}'

    r = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


# ------------------------------------------------------------------------------ concurrency


def test_sixteen_concurrent_streams_each_get_their_answer(server):
    subjects = ["cat", "dog", "bird", "fish", "tree", "sun", "moon", "star", "sky", "sea", "rain", "snow",
                "wind", "fire", "stone", "road"]
    prompts = [f"what is the {s}" for s in subjects]
    lengths = [8 + i % 5 for i in range(len(prompts))]
    expected = [chat_reference(server, p, n)[0] for p, n in zip(prompts, lengths)]

    async def one(http, prompt, n):
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": n, "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        events, done = sse_events(lines)
        assert done
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in events)

    async def all_of_them():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
            return await asyncio.wait_for(asyncio.gather(*(one(http, p, n) for p, n in zip(prompts, lengths))), 60)

    assert asyncio.run(all_of_them()) == expected


LONG_RUNNER = "the big dog and the small cat"  # the tiny model writes no eos for 4000 tokens after it


def _metric(http, name):
    total = 0.0
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_disconnect_cancels_its_request(server, http):
    before = _metric(http, "accel_http_cancelled_total")
    body = {"prompt": LONG_RUNNER, "max_tokens": CONTEXT - 16, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    deadline = time.monotonic() + 15
    while _metric(http, "accel_http_cancelled_total") <= before or _metric(http, "accel_requests_running") > 0:
        assert time.monotonic() < deadline, http.get("/metrics").text
        time.sleep(0.05)
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_client_that_gives_up_on_a_non_streaming_request_cancels_it(server, http, monkeypatch):
    before = _metric(http, "accel_http_cancelled_total")
    body = json.dumps({"prompt": LONG_RUNNER, "max_tokens": CONTEXT - 16, "temperature": 0}).encode()
    queued, cancelled, handles = threading.Event(), threading.Event(), []
    submit = server.engine.submit

    def watched_submit(*args, **kwargs):  # the server's submit: note the handle and its cancel
        handle = submit(*args, **kwargs)
        cancel = handle.cancel
        handle.cancel = lambda: (cancel(), cancelled.set())[0]
        handles.append(handle)
        queued.set()
        return handle

    with engine_held(server.engine, [5, 6, 7]):  # the request cannot run, let alone end, before its client leaves
        monkeypatch.setattr(server.engine, "submit", watched_submit)
        host, port = server.url.rsplit("/", 1)[1].split(":")
        with socket.create_connection((host, int(port)), timeout=30) as raw:
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            raw.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert queued.wait(30)  # the server submitted it to the engine; now the client hangs up
        assert cancelled.wait(30)  # the server saw the client go and cancelled the request
        assert _metric(http, "accel_http_cancelled_total") == before + 1
    (handle,) = handles
    result = handle.result(timeout=30)
    assert result.finish_reason == "cancelled" and result.tokens == []
    assert server.engine.metrics()["requests_running"] == 0


def test_metrics_are_prometheus_text(http):
    http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [("accel_requests_total", "counter"), ("accel_tokens_generated_total", "counter"),
                       ("accel_mean_accepted_tokens", "gauge"), ("accel_batch_occupancy", "gauge"),
                       ("accel_kv_bytes", "gauge"), ("accel_http_requests_total", "counter")]:
        assert f"# TYPE {name} {kind}" in text
    assert _metric(http, "accel_requests_total") >= 1
    assert 'accel_http_requests_total{code="200",path="/v1/completions"}' in text


class _FailingEngine:
    """An engine whose every request fails after one token, as a forward that raises would."""

    class Handle:
        def stream(self):
            yield accel.Delta([7], "hello")
            yield accel.Delta([], "", True, "error")

        def result(self, timeout=None):
            return accel.RequestResult([7], "hello", "error", 1, accel.Stats(), error="RuntimeError: boom")

        def cancel(self):
            pass

    def submit(self, prompt, **kwargs):
        return self.Handle()

    def metrics(self):
        return {}


def test_an_engine_failure_is_a_server_error_not_a_hang():
    from fastapi.testclient import TestClient

    app = create_app(_FailingEngine(), make_tiny_tokenizer(), model_id="x", context_length=64)
    with TestClient(app) as http:
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert "boom" in r.json()["error"]["message"]
        with http.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "stream": True}) as r:
            events, done = sse_events(r.iter_lines())
        assert done and events[0]["choices"][0]["text"] == "hello" and "boom" in events[-1]["error"]["message"]
        assert http.get("/health").status_code == 200


def test_health_reports_a_closed_engine():
    from fastapi.testclient import TestClient

    engine = accel.Engine(make_tiny_model(seed=1), max_batch=1)
    app = create_app(engine, make_tiny_tokenizer(), model_id="x", context_length=64)
    with TestClient(app) as http:
        assert http.get("/health").json()["status"] == "ok"
        engine.close()
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "unavailable"


# ------------------------------------------------------------------------------ pieces


def feed_all(matcher, pieces):
    out = []
    for piece in pieces:
        text, matched = matcher.feed(piece)
        out.append(text)
        if matched:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_matcher_holds_back_possible_starts():
    out, matched = feed_all(StopMatcher(["END"]), ["ab", "cE", "N", "D tail"])
    assert matched and out == ["ab", "c", "", ""]
    out, matched = feed_all(StopMatcher(["END"]), ["ab", "cE", "Nx", "y"])
    assert not matched and "".join(out) == "abcENxy" and out[1] == "c"
    out, matched = feed_all(StopMatcher(["xyz", "b"]), ["aaxy", "b"])
    assert matched and "".join(out) == "aaxy"  # 'b' occurs first; 'xy' is then plain text
    out, matched = feed_all(StopMatcher([]), ["a", "b"])
    assert out == ["a", "b", ""] and not matched
    out, matched = feed_all(StopMatcher(["aab"]), ["a", "a", "a", "b"])
    assert matched and "".join(out) == "a"


def test_cli_parses_serve_flags():
    from accel.cli import build_parser

    args = build_parser().parse_args(["serve", "--strategy", "snapkv:budget=64", "--port", "0", "--max-batch", "4",
                                      "--dtype", "bfloat16"])
    assert (args.host, args.port, args.max_batch, args.dtype, args.strategy) == (
        "127.0.0.1", 0, 4, "bfloat16", ["snapkv:budget=64"])


def test_cli_rejects_a_bad_strategy_before_loading(capsys):
    from accel.cli import main

    assert main(["serve", "--strategy", "warp_drive"]) == 2
    assert "unknown strategy" in capsys.readouterr().err


# ------------------------------------------------------------------------------ the load script


def _load_script():
    import importlib.util
    import sys

    if "serve_load" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
        spec = importlib.util.spec_from_file_location("serve_load", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["serve_load"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["serve_load"]


def test_load_script_refuses_other_hosts():
    load = _load_script()
    for url in ("http://10.0.0.1:8000", "http://example.com", "http://192.168.1.2", "ftp://127.0.0.1"):
        with pytest.raises(ValueError):
            load.loopback_url(url)
    assert load.loopback_url("http://127.0.0.2:9/") == "http://127.0.0.2:9"
    assert load.loopback_url("http://[::1]:8000") == "http://[::1]:8000"
    assert load.loopback_url("http://localhost:8000") == "http://localhost:8000"
    with pytest.raises(SystemExit):
        load.main(["--url", "http://10.1.2.3:8000"])


def test_load_script_smoke(server, capsys):
    load = _load_script()
    assert load.main(["--url", server.url, "--clients", "2", "--requests", "2", "--max-tokens", "4",
                      "--deadline", "60", "--timeout", "30"]) == 0
    out = capsys.readouterr().out
    assert "4 completed, 0 failed, 0 truncated" in out and "TTFT p50" in out
    assert load.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and load.percentile([], 95) is None
    # the engine's counters, read before and after the load: 2 clients, so 1-2 rows a step
    engine = re.search(r"engine: ([\d.]+) s in (\d+) verify steps \((\d+)% of the wall, \d+ ms each with "
                       r"([\d.]+) rows on average\), ([\d.]+) s in (\d+) prefills", out)
    assert engine, out
    step_s, steps, share, rows, prefill_s, prefills = map(float, engine.groups())
    assert step_s > 0 and steps >= 4 and 0 < share <= 100 and 1.0 <= rows <= 2.0
    assert prefill_s > 0 and 1 <= prefills <= 4  # one prefill per admission of one or both requests


def test_load_script_reads_engine_counters_and_skips_servers_without_them():
    load = _load_script()
    text = "\n".join(["# HELP accel_step_seconds_total Seconds.", "# TYPE accel_step_seconds_total counter",
                      "accel_step_seconds_total 10.5", "accel_prefill_seconds_total 1.5",
                      'accel_verify_steps_total{worker="0"} 60', 'accel_verify_steps_total{worker="1"} 40',
                      "accel_batch_rows_stepped_total 800", "accel_prefills_total 7", "other_total 3"])
    before = load.parse_counters(text)
    assert before["accel_verify_steps_total"] == 100.0 and before["accel_prefills_total"] == 7.0
    after = dict(before, accel_step_seconds_total=20.5, accel_verify_steps_total=150.0,
                 accel_batch_rows_stepped_total=1400.0, accel_prefill_seconds_total=2.0, accel_prefills_total=9.0)
    got = load.engine_time(before, after, wall=20.0)
    assert got["step_s"] == 10.0 and got["steps"] == 50 and got["step_share"] == 0.5
    assert got["ms_per_step"] == 200.0 and got["rows_per_step"] == 12.0
    assert got["prefills"] == 2 and got["prefill_s"] == 0.5 and got["prefill_share"] == 0.025
    # transformers serve has no such counters (or no /metrics): no engine line
    assert load.parse_counters("vllm_requests_total 3\n") is None
    assert load.parse_counters("accel_step_seconds_total x\n" + text) is None
    assert load.engine_time(None, after, 20.0) is None and load.engine_time(before, None, 20.0) is None


def test_accel_serve_command_end_to_end(tmp_path):
    """``accel serve --model DIR`` in a subprocess: loads, serves, and exits cleanly on Ctrl-C."""
    import os
    import signal
    import subprocess
    import sys

    folder = tmp_path / "tiny"
    make_tiny_model().save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "accel.cli", "serve", "--model", str(folder), "--port", str(port),
                             "--model-name", "tiny", "--max-batch", "2", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "accel serve did not come up"
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        models = httpx.get(url + "/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 512
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise
    assert rc == 0, proc.stdout.read()


# ------------------------------------------------------------------ log-probabilities


def _forward_logprobs(server, ids):
    """log_softmax of a plain float32 forward of ``ids`` on the reference copy: [n, V]."""
    with torch.no_grad():
        logits = server.reference_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_prompt_logprobs_equal_a_plain_forward(server, http):
    ids = server.tokenizer("the quick brown fox jumps over the lazy dog").input_ids
    for max_tokens in (0, 1):
        body = {"prompt": [ids], "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        n = len(ids)
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = _forward_logprobs(server, ids)
        for i in range(1, n):
            assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < 1e-4, i
            (best,) = lp["top_logprobs"][i].values()
            assert abs(best - ref[i - 1].max().item()) < 1e-4
        assert choice["text"].startswith(server.tokenizer.decode(ids))
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        if max_tokens:
            (gen,) = lp["token_logprobs"][n:]
            assert abs(gen - ref[n - 1].max().item()) < 1e-4  # greedy: the top token
            assert r.json()["usage"]["completion_tokens"] == 1


def test_generated_logprobs_match_a_forward_and_survive_drafting(server, http):
    ids = server.tokenizer("one two three one two three one two").input_ids
    answers = {}
    for strategies in ([], ["prompt_lookup"]):
        body = {"prompt": ids, "max_tokens": 8, "logprobs": 3, "temperature": 0, "accel": strategies}
        answers[bool(strategies)] = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    plain, drafted = answers[False], answers[True]
    assert plain["tokens"] == drafted["tokens"] and len(plain["tokens"]) == 8
    for a, b in zip(plain["token_logprobs"], drafted["token_logprobs"]):
        assert abs(a - b) < 1e-4
    greedy = accel.generate(server.reference_model, [ids], strategies=[], max_new_tokens=8)
    full = greedy.sequences[0].tolist()
    assert [server.tokenizer.decode([t]) for t in full[len(ids):]] == plain["tokens"]
    ref = _forward_logprobs(server, full)
    for j, (lp, top) in enumerate(zip(plain["token_logprobs"], plain["top_logprobs"])):
        assert len(top) <= 3 and abs(max(top.values()) - lp) < 1e-6  # greedy: the chosen one is the top one
        assert abs(lp - ref[len(ids) - 1 + j].max().item()) < 1e-4


def test_chat_logprobs_with_the_openai_client_streaming_and_not(client):
    kwargs = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Say hello"}], max_tokens=6,
                  temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-6 and entry.logprob <= 0
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    streamed = [e for chunk in client.chat.completions.create(**kwargs, stream=True) for c in chunk.choices
                if c.logprobs is not None for e in (c.logprobs.content or [])]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    plain = client.chat.completions.create(**{**kwargs, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_with_the_openai_client(client):
    out = client.completions.create(model=MODEL_ID, prompt="hello world", max_tokens=4, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(t.strip() in out.choices[0].text for t in lp.tokens)  # each token's own text (decoded alone)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
