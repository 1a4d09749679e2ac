"""accel on Ray: ``accel serve --ray`` (two replicas of a tiny random Llama behind the
prefix-affinity ingress, the ``openai`` client against Ray Serve's proxy) and
``accel bench --ray`` (grid points as Ray tasks). One local Ray cluster for the module (Ray
starts slowly), shut down at the end."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from ray import serve  # noqa: E402

import accel  # noqa: E402
import helpers  # noqa: E402
from accel.bench import load_config, run_experiment  # noqa: E402
from accel.cluster import connect  # noqa: E402
from accel.models import chat_ids  # noqa: E402
from accel.serving.ray_serve import (REPLICA_HEADER, PrefixAffinityRouter, ReplicaSpec, build_app,  # noqa: E402
                                     prefix_blocks, prompt_text)
from helpers import CharTokenizer, make_tiny_model, make_tiny_tokenizer, write_yaml  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL_ID = "tiny-llama"
CONTEXT = 1024
DOC = "the cat is on the road and the dog is in the house with a red door " * 6  # several prefix blocks


@pytest.fixture(scope="module")
def cluster():
    # The tests' helpers (CharTokenizer) travel to the workers by value: they cannot import them.
    ray.cloudpickle.register_pickle_by_value(helpers)
    connect(None, num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, log_to_driver=False,
            configure_logging=False)
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def url(cluster):
    """Two model replicas (max batch 4, a quarter CPU each: the sweep's tasks need one CPU of
    the two) behind the ingress, on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    spec = ReplicaSpec(model=MODEL_ID, max_batch=4, num_cpus=0.25, max_tokens=16)
    loaded = (make_tiny_model(max_position_embeddings=CONTEXT), make_tiny_tokenizer())
    serve.run(build_app(spec, replicas=2, loaded=loaded), name="accel", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.delete("accel")


@pytest.fixture(scope="module")
def client(url):
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=60.0) as c:
        yield c


def reference(content: str, max_new_tokens: int) -> str:
    """Greedy ``accel.generate`` on the same weights and chat prompt."""
    tokenizer = make_tiny_tokenizer()
    ids = chat_ids(tokenizer, [{"role": "user", "content": content}])
    model = make_tiny_model(max_position_embeddings=CONTEXT)
    return accel.generate(model, ids, strategies=[], max_new_tokens=max_new_tokens, tokenizer=tokenizer).text[0]


# ------------------------------------------------------------------------------ serve --ray


def test_openai_client_non_streaming_and_streaming_equal_generate(client):
    want = reference("hello world", 12)
    out = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "hello world"}],
                                         max_tokens=12, temperature=0)
    assert out.choices[0].message.content == want
    assert out.usage.completion_tokens >= 1

    want = reference("what is the sun", 10)
    chunks = list(client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "what is the sun"}], max_tokens=10, temperature=0,
        stream=True))
    assert len(chunks) > 2  # a stream of chunks through the proxy, not one body
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_same_prefix_lands_on_one_replica_and_reuses_its_entries(http):
    replicas, cached = set(), []
    for question in ("what", "who is", "where is the cat", "why", "how", "when is the sun"):
        r = http.post("/v1/chat/completions", json={
            "model": MODEL_ID, "messages": [{"role": "user", "content": DOC + question}], "max_tokens": 4,
            "temperature": 0})
        assert r.status_code == 200, r.text
        replicas.add(r.headers[REPLICA_HEADER])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(replicas) == 1
    assert all(c > 0 for c in cached[1:])  # the replica's prefix store served the shared document


def test_both_replicas_answer_and_a_replica_can_be_picked(http):
    seen = {http.get("/health").headers[REPLICA_HEADER] for _ in range(12)}
    assert len(seen) == 2  # requests without a prefix spread over the replicas
    for replica in seen:
        r = http.get("/metrics", headers={REPLICA_HEADER: replica})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == replica
        assert "accel_http_requests_total" in r.text


def test_bad_input_gets_the_app_s_openai_error(http):
    r = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hello", "max_tokens": -1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens"
    r = http.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()


LONG_RUNNER = "the big dog and the small cat"  # the tiny model writes no eos for 4000 tokens after it


def _metric(http, replica: str, name: str) -> float:
    text = http.get("/metrics", headers={REPLICA_HEADER: replica}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def test_client_disconnect_cancels_the_request_on_its_replica(url, http):
    body = {"model": MODEL_ID, "prompt": LONG_RUNNER, "max_tokens": CONTEXT - 64, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60.0) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            replica = r.headers[REPLICA_HEADER]
            before = _metric(http, replica, "accel_http_cancelled_total")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one chunk, then hang up
    deadline = time.monotonic() + 30
    while (_metric(http, replica, "accel_http_cancelled_total") <= before
           or _metric(http, replica, "accel_requests_running") > 0):
        assert time.monotonic() < deadline, http.get("/metrics", headers={REPLICA_HEADER: replica}).text
        time.sleep(0.2)


def test_a_killed_replica_ends_its_stream_with_an_error_and_the_other_serves(url, http):
    """Last of the serve tests: it kills a replica (Serve starts a new one later)."""
    body = {"model": MODEL_ID, "prompt": LONG_RUNNER, "max_tokens": CONTEXT - 64, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=60.0) as other:
        with other.stream("POST", "/v1/completions", json=body) as r:
            replica = r.headers[REPLICA_HEADER]
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            ray.kill(ray.get_actor(f"SERVE_REPLICA::accel#model#{replica}", namespace="serve"), no_restart=True)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: "):])["error"]
    assert error["code"] == "replica_unavailable" and "replica" in error["message"]
    for _ in range(3):  # the survivor answers, even a request pinned to the dead replica
        r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3}, headers={REPLICA_HEADER: replica})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] != replica


# ------------------------------------------------------------------------------ routing, offline


def test_prefix_keys_and_router_preference():
    def blocks(content: str) -> list[bytes]:
        body = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
        return prefix_blocks(prompt_text("/v1/chat/completions", body))

    a, b = blocks(DOC + "a"), blocks(DOC[:100] + "X" + DOC[101:])  # b differs in its second block
    assert len(a) == len(b) >= 4 and a[0] == b[0] and a[1] != b[1]
    assert prompt_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == "1,2,3,"
    assert prompt_text("/v1/completions", b"[1]") is None and prefix_blocks(None) == []

    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # the policy alone, no Serve machinery
    router.initialize_state(max_imbalance=2)
    router.blocks = {"r1": dict.fromkeys(a[:2]), "r2": dict.fromkeys(a)}
    assert router.matched("r1", a) == 2 and router.matched("r2", a) == len(a) and router.matched("r3", a) == 0
    assert router.matched("r1", b) == 1 and router.matched("r2", b) == 1


# ------------------------------------------------------------------------------ bench --ray

SWEEP = {
    "model": "default",
    "tasks": [{"kind": "chat", "prompts": 2}],
    "baselines": ["hf_generate"],
    "runs": {"accel_plain": [], "pl": ["prompt_lookup:num_tokens=4"]},
    "generation": {"max_new_tokens": 6},
    "warmup_tokens": 2,
    "seed": 1,
    "threads": 1,
}
TIMINGS = {"prefill_s", "decode_s", "decode_tok_s", "e2e_s", "peak_rss_mib", "peak_gpu_mib"}


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in (out / "results.jsonl").read_text().splitlines()]


def test_sweep_over_ray_writes_the_local_rows_and_resumes(tmp_path, cluster):
    exp = load_config(write_yaml(tmp_path, SWEEP))
    model = make_tiny_model(max_position_embeddings=CONTEXT)
    local = run_experiment(exp, tmp_path / "local", model=model, tokenizer=CharTokenizer(), quiet=True)
    over = run_experiment(exp, tmp_path / "ray", model=model, tokenizer=CharTokenizer(), quiet=True, ray=True)
    assert _rows(over) == _rows(local) and len(_rows(over)) == 2 * 3
    assert (over / "summary.md").exists()

    # An interrupted sweep: the second point's rows are gone, the first one's are marked.
    lines = (over / "results.jsonl").read_text().splitlines()
    kept = [json.loads(line) | {"text": "kept from before"} for line in lines[:3]]
    (over / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + lines[3][:20])
    run_experiment(exp, tmp_path / "ray", model=model, tokenizer=CharTokenizer(), quiet=True, ray=True)
    again = _rows(over)
    assert [r["text"] for r in again[:3]] == ["kept from before"] * 3  # not rerun
    assert again[3:] == _rows(local)[3:]  # rerun


def test_ray_bench_refuses_batched_grids_before_writing(tmp_path, cluster):
    exp = load_config(write_yaml(tmp_path, dict(SWEEP, batch_sizes=[1, 2])))
    with pytest.raises(ValueError, match="per-item grid"):
        run_experiment(exp, tmp_path / "out", model=make_tiny_model(), tokenizer=CharTokenizer(), quiet=True, ray=True)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ bad input


def _cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"{prelude}import sys; from accel.cli import main; sys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_ray_flag_without_ray_names_the_extra():
    no_ray = "import sys; sys.modules['ray'] = None; "
    for args in (("serve", "--ray"), ("bench", str(ROOT / "configs" / "quickstart.yaml"), "--ray")):
        done = _cli(*args, prelude=no_ray)
        assert done.returncode == 2, done.stderr
        assert "pip install 'accel[ray]'" in done.stderr


def test_wrong_address_fails_fast_naming_it():
    t0 = time.monotonic()
    done = _cli("serve", "--ray", "--model", "nowhere", "--address", "127.0.0.1:9")
    assert done.returncode == 2, done.stderr
    assert "127.0.0.1:9" in done.stderr and "cannot reach the Ray cluster" in done.stderr
    assert time.monotonic() - t0 < 30
    done = _cli("bench", str(ROOT / "configs" / "quickstart.yaml"), "--ray", "--address", "nowhere")
    assert done.returncode == 2 and "expected HOST:PORT" in done.stderr
