"""accel bench: experiment-file validation, task generation, and a tiny end-to-end run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accel.bench import ConfigError, load_config, run_experiment
from accel.kernels.cpu import PackedLinear, prepack, prepack_supported
from accel.bench.runner import _agreement, schedule
from accel.bench.experiment_file import apply_overrides
from accel.bench.tasks import build_items, score
from accel.cli import main
from accel.strategy import REGISTRY, _load_builtin

from helpers import CONFIGS, CharTokenizer, make_tiny_model, write_yaml

GOOD = {
    "model": "default",
    "tasks": [
        {"kind": "needle", "lengths": [400, 600], "depths": [0.0, 1.0]},
        {"kind": "long_doc", "lengths": [900], "instructions": ["repeat", "extract"]},
        {"kind": "chat", "prompts": 2},
    ],
    "baselines": ["hf_generate", "hf_prompt_lookup"],
    "runs": {
        "accel_plain": [],
        "snapkv": [{"name": "snapkv", "budget": 64, "window": 8, "kernel": 3}],
        "snapkv_pl": ["snapkv:budget=64,window=8,kernel=3", "prompt_lookup:num_tokens=4"],
    },
    "generation": {"max_new_tokens": 8},
    "warmup_tokens": 2,
    "seed": 3,
    "threads": 1,  # a shared 2-core machine runs tiny models far faster on one thread
}


# --------------------------------------------------------------------------- schema


def test_good_file_validates(tmp_path):
    exp = load_config(write_yaml(tmp_path, GOOD))
    assert exp.name == "exp"
    assert exp.configuration_names() == ["hf_generate", "hf_prompt_lookup", "accel_plain", "snapkv", "snapkv_pl"]
    assert [t.kind for t in exp.tasks] == ["needle", "long_doc", "chat"]
    assert exp.generation.max_new_tokens == 8 and exp.reference == "hf_generate"


def test_budget_and_misspelled_field_both_named_in_one_message(tmp_path):
    bad = dict(GOOD, runs={"snapkv_bad": [{"name": "snapkv", "budget": -5, "windw": 32}]})
    path = write_yaml(tmp_path, bad)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "budget" in msg and "greater than 0" in msg
    assert "windw" in msg
    assert len(info.value.problems) == 2
    for line in msg.splitlines():
        assert line.startswith(f"{path}: runs.snapkv_bad[0]: snapkv.")


def test_every_schema_and_strategy_error_is_collected(tmp_path):
    bad = {
        "tasks": [{"kind": "needle", "lengths": [0], "depths": [1.5]}, {"kind": "poem"}],
        "runs": {"x": ["nosuch"], "hf_generate": [], "two": ["snapkv", "h2o"]},
        "generation": {"max_new_tokens": 0, "temprature": 1},
        "repeats": "many",
    }
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, bad))
    msg = str(info.value)
    for needle in ("tasks[0].needle.lengths[0]", "tasks[0].needle.depths[0]", "tasks[1]", "generation.max_new_tokens",
                   "generation.temprature", "repeats", "runs.x[0]: unknown strategy 'nosuch'", "runs.two: at most one"):
        assert needle in msg, needle


def test_model_level_checks(tmp_path):
    bad = dict(GOOD, reference="nope", runs={"hf_generate": []})
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, bad))
    msg = str(info.value)
    assert "runs.hf_generate: 'hf_generate' is a baseline name" in msg
    assert "reference: 'nope' is neither a baseline nor a run" in msg


def test_yaml_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"exp.yaml: line \d+, column \d+: YAML syntax error"):
        load_config(write_yaml(tmp_path, "tasks:\n  - kind: [chat\n"))
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "absent.yaml")


def test_overrides(tmp_path):
    exp = load_config(write_yaml(tmp_path, GOOD), [
        "generation.max_new_tokens=4", "tasks[0].lengths=[100]", "runs.pl=[prompt_lookup]", "repeats=2",
        "baselines=[hf_generate]",
    ])
    assert exp.generation.max_new_tokens == 4
    assert exp.tasks[0].lengths == [100]
    assert "pl" in exp.runs and exp.repeats == 2
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, GOOD), ["repeats", "tasks[9].lengths=[1]", "runs.snapkv=[snapkv:budget=-1]"])
    msg = str(info.value)
    assert "--set repeats: expected KEY=VALUE" in msg
    assert "--set tasks[9].lengths=[1]: tasks[9].lengths does not name a field" in msg
    assert "runs.snapkv[0]: snapkv.budget: Input should be greater than 0" in msg


def test_apply_overrides_creates_nested_mappings():
    data: dict = {}
    assert apply_overrides(data, ["generation.system=Be brief."]) == []
    assert data == {"generation": {"system": "Be brief."}}


def test_shipped_configs_validate():
    _load_builtin()
    paths = sorted(CONFIGS.glob("*.yaml"))
    assert {p.name for p in paths} >= {"quickstart.yaml", "needle.yaml", "long_doc.yaml", "chat.yaml"}
    for path in paths:
        try:
            load_config(path)
        except ConfigError as err:
            # Medusa heads may not be registered yet; nothing else may be wrong.
            assert "medusa" not in REGISTRY, str(err)
            assert all("unknown strategy 'medusa'" in p for p in err.problems), str(err)


# --------------------------------------------------------------------------- CLI


def test_cli_bad_file_exits_nonzero_without_traceback_or_output(tmp_path, capsys):
    out = tmp_path / "out"
    bad = dict(GOOD, runs={"snapkv": [{"name": "snapkv", "budget": -5, "windw": 32}]}, output=str(out))
    path = write_yaml(tmp_path, bad)
    rc = main(["bench", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "Traceback" not in err
    assert "snapkv.budget" in err and "windw" in err and str(path) in err
    assert not out.exists()
    rc = main(["bench", str(path)])  # the file's own output folder is not created either
    assert rc != 0 and not out.exists()


# --------------------------------------------------------------------------- tasks


def test_tasks_are_deterministic_and_fit_their_lengths(tmp_path):
    tok = CharTokenizer()
    exp = load_config(write_yaml(tmp_path, GOOD))
    a, b = build_items(exp, tok), build_items(exp, tok)
    assert [i.item_id for i in a] == [i.item_id for i in b]
    assert all(torch.equal(x.input_ids, y.input_ids) for x, y in zip(a, b))
    needles = [i for i in a if i.kind == "needle"]
    assert len(needles) == 4
    for item in needles:
        text = tok.decode(item.input_ids[0].tolist())
        assert f"The pass key is {item.meta['pass_key']}. Remember it." in text
        assert text.rstrip().endswith("What is the pass key?\n<assistant>")
        assert item.meta["target_length"] * 0.8 <= item.prompt_tokens <= item.meta["target_length"]
    first, last = (tok.decode(needles[k].input_ids[0].tolist()) for k in (0, 1))  # depths 0 and 1
    assert "quiz you about the pass key.\n\nThe pass key is" in first
    assert "is the pass key.\n\nWhat is the pass key?" in last
    other = load_config(write_yaml(tmp_path, dict(GOOD, seed=4), "other.yaml"))
    assert [i.meta.get("pass_key") for i in build_items(other, tok)] != [i.meta.get("pass_key") for i in a]


def test_scoring(tmp_path):
    tok = CharTokenizer()
    exp = load_config(write_yaml(tmp_path, GOOD))
    items = {(i.kind, i.meta.get("instruction")): i for i in build_items(exp, tok)}
    needle = items[("needle", None)]
    assert score(needle, f"The pass key is {needle.expected}.") == (True, 1.0)
    assert score(needle, "I do not know.") == (False, 0.0)
    extract = items[("long_doc", "extract")]
    names = extract.expected
    assert score(extract, "\n".join(names)) == (True, 1.0)
    assert score(extract, names[0])[1] == pytest.approx(1 / len(names))
    repeat = items[("long_doc", "repeat")]
    assert score(repeat, "Sure:\n" + repeat.expected + " and more")[0] is True
    assert score(items[("chat", None)], "anything") == (None, None)


def test_agreement_and_rotation():
    assert _agreement([1, 2, 3], [1, 2, 3]) == 1.0
    assert _agreement([1, 9, 3], [1, 2, 3, 4]) == 0.25
    assert _agreement([], []) == 1.0

    class C:
        def __init__(self, name):
            self.name, self.unavailable = name, None

    configs = [C("a"), C("b"), C("c")]
    orders = [[c.name for c in order] for _, _, order in schedule(configs, [0, 1, 2], 2)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert orders[3] == ["b", "c", "a"]  # the next repeat starts one further on
    for order in orders:
        assert sorted(order) == ["a", "b", "c"]


# --------------------------------------------------------------------------- end to end


def test_tiny_end_to_end_writes_results_summary_and_plots(tmp_path):
    exp = load_config(write_yaml(tmp_path, GOOD))
    threads = torch.get_num_threads()
    out = run_experiment(exp, tmp_path / "out", model=make_tiny_model(max_position_embeddings=2048), tokenizer=CharTokenizer(),
                         command="pytest tiny", quiet=True)

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    n_items = 4 + 2 + 2
    assert len(rows) == n_items * 5
    assert not [r["error"] for r in rows if r["error"]]
    for r in rows:
        assert r["prompt_tokens"] > 0 and r["new_tokens"] >= 1
        assert r["e2e_s"] > 0 and r["prefill_s"] > 0
        assert r["kv_bytes_kept"] <= r["kv_bytes_full"]
        assert r["peak_rss_mib"] and r["peak_rss_mib"] > 0
        assert r["agreement"] is not None and isinstance(r["text"], str)
    by = {(r["config"], r["task"], r["item"]): r for r in rows}
    for (config, task, item), r in by.items():
        if config in ("accel_plain", "hf_prompt_lookup"):  # exact methods reproduce greedy decoding
            assert r["exact"], (config, task, item)
        if config.startswith("snapkv") and r["prompt_tokens"] > 64:
            assert r["kv_bytes_kept"] < r["kv_bytes_full"]
    assert all(r["correct"] is not None for r in rows if r["kind"] == "needle")

    summary = (out / "summary.md").read_text()
    assert "pytest tiny" in summary and "Machine:" in summary
    assert "## Task `needle`" in summary and "## Task `long_doc`" in summary and "## Task `chat`" in summary
    assert "| `snapkv_pl` |" in summary and "(ref)" in summary
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "speedup_vs_length.png" in pngs and "needle_needle.png" in pngs
    assert all((out / p).stat().st_size > 1000 for p in pngs)
    assert json.loads((out / "experiment.json").read_text())["seed"] == 3
    assert torch.get_num_threads() == threads  # `threads: 1` applied during the run only


def test_failed_runs_are_recorded_and_unavailable_baselines_reported(tmp_path, monkeypatch):
    from accel.bench import configurations

    real = configurations._accel_run

    def flaky(model, strategies, eos, max_draft, sampling, *rest):
        if not strategies:
            return real(model, strategies, eos, max_draft, sampling, *rest)

        def boom(item, max_new_tokens):
            raise RuntimeError("boom")

        return boom

    monkeypatch.setattr(configurations, "_accel_run", flaky)
    monkeypatch.setitem(__import__("sys").modules, "kvpress", None)  # as if kvpress did not import
    data = dict(GOOD, tasks=[{"kind": "chat", "prompts": 2}], baselines=["hf_generate", "kvpress_snapkv"],
                runs={"accel_plain": [], "broken": ["prompt_lookup"]})
    out = run_experiment(load_config(write_yaml(tmp_path, data)), tmp_path / "out", model=make_tiny_model(),
                         tokenizer=CharTokenizer(), quiet=True)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["config"] for r in rows}) == ["accel_plain", "broken", "hf_generate"]
    assert all(r["error"] == "RuntimeError: boom" for r in rows if r["config"] == "broken")
    assert all(r["exact"] for r in rows if r["config"] == "accel_plain")
    summary = (out / "summary.md").read_text()
    assert "`broken` ⚠ 2 failed" in summary and "RuntimeError: boom" in summary
    assert "**unavailable:** kvpress does not import here" in summary


def test_draft_model_run_and_hf_assisted_baseline(tmp_path):
    from helpers import SMALL_DRAFT

    draft_dir = tmp_path / "draft"
    make_tiny_model(seed=9, **SMALL_DRAFT).save_pretrained(draft_dir)  # a checkpoint folder without tokenizer
    data = dict(GOOD, tasks=[{"kind": "chat", "prompts": 2}],
                baselines=["hf_generate", {"name": "hf_assisted", "model": str(draft_dir), "num_tokens": 3}],
                runs={"draft_model": [{"name": "draft_model", "model": str(draft_dir), "num_tokens": 3}]})
    exp = load_config(write_yaml(tmp_path, data))
    assert exp.configuration_names() == ["hf_generate", "hf_assisted", "draft_model"]
    out = run_experiment(exp, tmp_path / "out", model=make_tiny_model(), tokenizer=CharTokenizer(), quiet=True)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted({r["config"] for r in rows}) == ["draft_model", "hf_assisted", "hf_generate"]
    assert not [r["error"] for r in rows if r["error"]]
    assert all(r["exact"] for r in rows)  # both draft-model methods reproduce greedy decoding

    with pytest.raises(ConfigError, match="hf_assisted.model: Field required"):
        load_config(write_yaml(tmp_path, dict(GOOD, baselines=["hf_generate", "hf_assisted"])))
    missing = dict(data, baselines=["hf_generate", {"name": "hf_assisted", "model": str(tmp_path / "nowhere")}], runs={})
    out = run_experiment(load_config(write_yaml(tmp_path, missing)), tmp_path / "out2", model=make_tiny_model(),
                         tokenizer=CharTokenizer(), quiet=True)
    assert "**unavailable:** draft model" in (out / "summary.md").read_text()


def test_sampled_runs_are_seeded_per_item_and_not_compared(tmp_path):
    import accel
    from accel.bench.configurations import Sampling

    data = dict(GOOD, tasks=[{"kind": "chat", "prompts": 2}], baselines=["hf_generate"],
                runs={"accel_plain": [], "pl": ["prompt_lookup:num_tokens=4"]},
                generation={"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9})
    exp = load_config(write_yaml(tmp_path, data))
    model = make_tiny_model()
    out = run_experiment(exp, tmp_path / "out", model=model, tokenizer=CharTokenizer(), quiet=True)
    rows = _rows(out)
    assert not [r["error"] for r in rows if r["error"]]
    assert all(r["exact"] is None and r["agreement"] is None for r in rows)
    assert "sampled at temperature 0.7, top_p 0.9" in (out / "summary.md").read_text()
    # each accel row is accel.generate with the item's seed: rerunning it gives the same tokens
    items = {i.item_id: i for i in build_items(exp, CharTokenizer())}
    sampling = Sampling(0.7, 0.9, exp.seed)
    for r in (r for r in rows if r["config"] == "accel_plain"):
        item = items[r["item"]]
        again = accel.generate(model, item.input_ids, max_new_tokens=10, temperature=0.7, top_p=0.9,
                               seed=sampling.item_seed(item), eos_token_id=[CharTokenizer.eos_token_id])
        assert CharTokenizer().decode(again.sequences[0, item.prompt_tokens:].tolist()) == r["text"]
    assert sampling.item_seed(items[rows[0]["item"]]) != sampling.item_seed(items[rows[-1]["item"]])

    for bad, field in ((dict(data, batch_sizes=[1, 2]), "generation.temperature"),
                       (dict(data, generation={"top_p": 0.5}), "generation.top_p")):
        with pytest.raises(ConfigError, match=field):
            load_config(write_yaml(tmp_path, bad))


# --------------------------------------------------------------------------- batched and arrivals


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


BATCHED = {
    "tasks": [{"kind": "chat", "prompts": 3}, {"kind": "long_doc", "lengths": [300], "instructions": ["repeat"]}],
    "baselines": ["hf_generate", "hf_prompt_lookup", "hf_generate_batch"],
    "runs": {"accel_plain": [], "pl": ["prompt_lookup:num_tokens=4"]},
    "generation": {"max_new_tokens": 8},
    "batch_sizes": [1, 2],
    "warmup_tokens": 2,
    "threads": 1,
}


def test_batch_sizes_and_arrivals_errors_name_the_field(tmp_path):
    bad = dict(GOOD, batch_sizes=[0, 4, 4, "many"], arrivals={"requests": 0, "interval_s": -1, "task": "poems"})
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, bad))
    msg = str(info.value)
    for needle in ("batch_sizes[0]: Input should be greater than 0", "batch_sizes[3]", "arrivals.requests",
                   "arrivals.interval_s"):
        assert needle in msg, needle
    with pytest.raises(ConfigError, match=r"batch_sizes: List should have at least 1 item"):
        load_config(write_yaml(tmp_path, dict(GOOD, batch_sizes=[])))
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, dict(GOOD, batch_sizes=[1, 4, 4], arrivals={"task": "poems"})))
    msg = str(info.value)
    assert "batch_sizes: 4 is listed twice" in msg
    assert "arrivals.task: 'poems' is not a task" in msg
    exp = load_config(write_yaml(tmp_path, dict(GOOD, batch_sizes=[1, 8], arrivals={"requests": 4})))
    assert exp.batched and exp.arrivals.interval_s == 0.25 and exp.arrivals.max_batch is None
    assert not load_config(write_yaml(tmp_path, GOOD)).batched


def test_make_groups_cycle_a_task_s_items(tmp_path):
    from accel.bench.runner import make_groups

    exp = load_config(write_yaml(tmp_path, dict(GOOD, tasks=[{"kind": "chat", "prompts": 5}, {"kind": "chat", "name": "two",
                                                                                       "prompts": 2}])))
    items = build_items(exp, CharTokenizer())
    groups = make_groups(items, [1, 2, 4])
    chat = {b: [[i.item_id for i in g.items] for g in groups if g.task == "chat" and g.batch_size == b] for b in (1, 2, 4)}
    assert len(chat[1]) == 5 and chat[2] == [["p00", "p01"], ["p02", "p03"], ["p04", "p00"]]
    assert chat[4] == [["p00", "p01", "p02", "p03"], ["p04", "p00", "p01", "p02"]]
    two = [[i.item_id for i in g.items] for g in groups if g.task == "two" and g.batch_size == 4]
    assert two == [["p00", "p01", "p00", "p01"]]  # fewer items than B: cycled


def test_chunk_timer_and_percentile():
    from accel.bench.measurement import ChunkTimer, percentile

    timer = ChunkTimer(rows=3)
    timer.start()
    timer.put(torch.zeros(3, 7))  # the prompt
    for _ in range(4):
        timer.put(torch.zeros(3, dtype=torch.long))
    assert [n for _, n in timer.chunks] == [1, 1, 1, 1]
    assert timer.time_of_token(0) == timer.chunks[0][0] and timer.time_of_token(3) == timer.chunks[3][0]
    assert timer.time_of_token(4) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([0.0, 10.0], 95) == pytest.approx(9.5)
    assert percentile([], 50) is None


def test_batched_grid_rows_exact_and_same_as_single_rows(tmp_path):
    model = make_tiny_model(max_position_embeddings=2048)
    out = run_experiment(load_config(write_yaml(tmp_path, BATCHED)), tmp_path / "batched", model=model,
                         tokenizer=CharTokenizer(), command="pytest batched", quiet=True)
    assert model.config._attn_implementation == "sdpa"  # continuous batching put it back
    rows = _rows(out)
    assert all(r["mode"] == "batch" and not r["error"] and r["failures"] == 0 for r in rows), [r["error"] for r in rows]
    # chat: 3 + 2 groups (the second of B=2 cycles to p00), long_doc (1 item): 1 + 1; hf_prompt_lookup
    # only at batch size 1
    seen = {(r["task"], r["batch_size"], r["group"], r["config"]) for r in rows}
    assert len(rows) == len(seen)
    assert {(t, b) for t, b, _, c in seen if c == "hf_prompt_lookup"} == {("chat", 1), ("long_doc", 1)}
    for config in ("hf_generate", "hf_generate_batch", "accel_plain", "pl"):
        assert len([k for k in seen if k[3] == config]) == 7, config
    for r in rows:
        assert len(r["rows"]) == r["batch_size"] == len(r["items"])
        assert r["tok_s"] > 0 and r["new_tokens"] == sum(p["new_tokens"] for p in r["rows"])
        assert r["peak_rss_mib"] > 0 and r["kv_bytes_full"] > 0
        assert r["compared_rows"] == r["batch_size"] and r["exact_rows"] == r["batch_size"], (r["config"], r["task"])
        for p in r["rows"]:
            assert p["exact"] is True and p["agreement"] == 1.0
            assert 0 < p["first_token_s"] <= p["latency_s"] <= r["e2e_s"] + 1e-6
        if r["config"] in ("accel_plain", "pl"):
            assert r["kv_bytes_kept"] == r["kv_bytes_full"]
        if r["config"] == "hf_generate":  # the padded cache holds at least every row's own entries
            assert r["kv_bytes_kept"] >= r["kv_bytes_full"]
    # a row's output in a batch is what it is alone: same text as the per-item grid
    single = run_experiment(load_config(write_yaml(tmp_path, dict(BATCHED, batch_sizes=[1], baselines=["hf_generate"]),
                                               "single.yaml")), tmp_path / "single", model=model,
                            tokenizer=CharTokenizer(), quiet=True)
    alone = {(r["config"], r["task"], r["item"]): r["text"] for r in _rows(single)}
    assert all("mode" not in r for r in _rows(single))  # the per-item grid's rows are as before
    for r in rows:
        if r["config"] in ("accel_plain", "pl", "hf_generate"):
            for item, p in zip(r["items"], r["rows"]):
                assert p["text"] == alone[(r["config"], r["task"], item)], (r["config"], r["batch_size"], item)

    summary = (out / "summary.md").read_text()
    assert "## Task `" not in summary  # no per-item tables in a batched experiment
    assert "## Batched: task `chat` (chat), batch size 2 (2 group(s) of 2" in summary and "## Batched: task `long_doc`" in summary
    assert "| `hf_generate` (ref) |" in summary and "| `hf_generate_batch` |" in summary and "| `pl` |" in summary
    assert "Not run at this batch size: `hf_prompt_lookup` (transformers' assisted generation" in summary
    assert "attention sdpa" in summary
    assert (out / "throughput_vs_batch.png").stat().st_size > 1000


def test_arrivals_record_latency_and_ttft_for_every_request(tmp_path):
    data = dict(BATCHED, tasks=[{"kind": "chat", "prompts": 3}],
                baselines=["hf_generate", "hf_generate_unpacked", "hf_generate_batch"],
                runs={"accel_plain": []}, batch_sizes=[1], arrivals={"requests": 5, "interval_s": 0.01, "max_batch": 2})
    model = make_tiny_model()
    packed = prepack_supported()
    if packed:  # hf_generate_unpacked swaps in plain kernels for its calls only
        prepack(model, min_rows=2, max_rows=64)
    out = run_experiment(load_config(write_yaml(tmp_path, data)), tmp_path / "out", model=model, tokenizer=CharTokenizer(),
                         quiet=True)
    assert model.config._attn_implementation == "sdpa"
    if packed:
        assert {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)} == {(2, 64)}
    rows = _rows(out)
    single = [r for r in rows if "mode" not in r]
    assert len(single) == 4 * 3 and all(r["exact"] for r in single)  # the per-item grid still runs
    arrivals = [r for r in rows if r.get("mode") == "arrivals"]
    assert sorted(r["config"] for r in arrivals) == ["accel_plain", "hf_generate", "hf_generate_batch",
                                                     "hf_generate_unpacked"]
    for r in arrivals:
        assert not r["error"] and r["failures"] == 0
        assert r["requests"] == 5 and r["batch_size"] == 2 and r["interval_s"] == 0.01
        assert r["items"] == ["p00", "p01", "p02", "p00", "p01"]
        assert len(r["rows"]) == 5 and r["tok_s"] > 0 and r["e2e_s"] >= 4 * 0.01
        for p in r["rows"]:
            assert 0 < p["first_token_s"] <= p["latency_s"], r["config"]
            assert p["exact"] is True
        assert r["latency_p50_s"] <= r["latency_p95_s"]
    summary = (out / "summary.md").read_text()
    assert "## Task `chat`" in summary  # the per-item table, as before
    assert "## Arrivals: 5 `chat` requests, one every 0.01 s, at most 2 decoded together" in summary
    assert "| `accel_plain` |" in summary.split("## Arrivals")[1]


def test_unrunnable_baseline_and_reference_in_batched_mode(tmp_path, monkeypatch):
    from accel.bench import continuous_batching

    monkeypatch.setattr(continuous_batching, "cb_probe", lambda *a: (None, "continuous batching does not run here (test)"))
    data = dict(BATCHED, tasks=[{"kind": "chat", "prompts": 2}], baselines=["hf_generate", "hf_generate_batch"],
                runs={"accel_plain": []}, batch_sizes=[1, 2])
    out = run_experiment(load_config(write_yaml(tmp_path, data)), tmp_path / "out", model=make_tiny_model(),
                         tokenizer=CharTokenizer(), quiet=True)
    assert {r["config"] for r in _rows(out)} == {"hf_generate", "accel_plain"}
    assert "**unavailable:** continuous batching does not run here (test)" in (out / "summary.md").read_text()
    bad = dict(data, baselines=["hf_generate", "hf_prompt_lookup"], reference="hf_prompt_lookup")
    with pytest.raises(ValueError, match="reference 'hf_prompt_lookup' cannot run batches of 2"):
        run_experiment(load_config(write_yaml(tmp_path, bad, "bad.yaml")), tmp_path / "bad", model=make_tiny_model(),
                       tokenizer=CharTokenizer(), quiet=True)
    assert not (tmp_path / "bad").exists()


def test_code_file_items_fit_their_length_at_a_line_boundary(tmp_path):
    code = "\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(200))
    (tmp_path / "mod.py").write_text(code)
    data = dict(GOOD, tasks=[{"kind": "code_file", "files": ["mod.py"], "lengths": [300, 900],
                              "instruction": "Return it."}])
    exp = load_config(write_yaml(tmp_path, data))
    items = build_items(exp, CharTokenizer())
    assert [i.item_id for i in items] == ["mod-L300", "mod-L900"]
    for item, length in zip(items, (300, 900)):
        text = CharTokenizer().decode(item.input_ids[0].tolist())
        assert item.prompt_tokens <= length and item.meta["lines"] > 1
        body = text.split("```python\n", 1)[1].split("\n```", 1)[0]
        assert body == "\n".join(code.splitlines()[: item.meta["lines"]])  # whole lines, from the top
        assert text.rstrip().endswith("Return it.\n<assistant>".rstrip())
        # one line more would not fit
        longer = "\n".join(code.splitlines()[: item.meta["lines"] + 1])
        assert len(text) - len(body) + len(longer) > length
    with pytest.raises(ConfigError, match=r"tasks\[0\]\.files\[0\]: no such file"):
        load_config(write_yaml(tmp_path, dict(data, tasks=[{"kind": "code_file", "files": ["nowhere.py"]}])))


def test_warm_up_prompts_are_cut_to_their_last_tokens():
    from accel.bench.runner import WARMUP_PROMPT, _warmup_item
    from accel.bench.tasks import TaskItem

    long = TaskItem(task="t", kind="chat", item_id="x", input_ids=torch.arange(WARMUP_PROMPT + 50).unsqueeze(0))
    cut = _warmup_item(long)
    assert cut.prompt_tokens == WARMUP_PROMPT and cut.input_ids[0, -1] == long.input_ids[0, -1]
    assert long.prompt_tokens == WARMUP_PROMPT + 50  # the item itself is untouched
    short = TaskItem(task="t", kind="chat", item_id="y", input_ids=torch.arange(10).unsqueeze(0))
    assert _warmup_item(short) is short


SHARED = {
    "tasks": [{"kind": "needle", "lengths": [500], "depths": [0.2, 0.8]}],
    "baselines": [],
    "reference": "full",
    "runs": {"full": [], "snapkv": ["snapkv:budget=64,window=8,kernel=3"],
             "snapkv_pl": ["snapkv:budget=96,window=8,kernel=3", "prompt_lookup:num_tokens=4"]},
    "generation": {"max_new_tokens": 8, "prefill_chunk": 128},
    "warmup_tokens": 2,
    "threads": 1,
}


def test_shared_prefill_rows_match_runs_that_prefill_on_their_own(tmp_path, monkeypatch):
    model = make_tiny_model(max_position_embeddings=2048)
    alone = _rows(run_experiment(load_config(write_yaml(tmp_path, SHARED)), tmp_path / "alone", model=model,
                                 tokenizer=CharTokenizer(), quiet=True))
    shared_spec = dict(SHARED, generation=dict(SHARED["generation"], share_prefill=True, one_forward_items=1))
    started = _count_starts(monkeypatch)
    out = run_experiment(load_config(write_yaml(tmp_path, shared_spec)), tmp_path / "shared", model=model,
                         tokenizer=CharTokenizer(), quiet=True)
    rows = _rows(out)
    prefills = [r for r in rows if r.get("mode") == "prefill"]
    assert [(r["item"].endswith("/one_forward"), r["prefill_chunk"]) for r in prefills] == \
        [(False, 128), (True, None), (False, 128)]
    for r in prefills:
        assert r["error"] is None and r["prefill_s"] > 0 and r["peak_rss_mib"] >= r["rss_before_mib"] > 0
    runs = {(r["config"], r["item"]): r for r in rows if r.get("mode", "single") == "single"}
    assert len(runs) == 3 * 3
    for r in alone:
        mine = runs[(r["config"], r["item"])]
        assert mine["text"] == r["text"] and mine["kv_bytes_kept"] == r["kv_bytes_kept"], r["config"]
        again = runs[(r["config"], r["item"] + "/one_forward")] if r["item"] == prefills[0]["item"] else None
        if again is not None:  # the same answer and cache from the one-forward prefill
            assert again["text"] == r["text"] and again["kv_bytes_kept"] == r["kv_bytes_kept"]
    assert all(r["exact"] for r in runs.values() if r["config"] == "full")
    assert len(started) == 3 + 3 * 3  # the warm-ups (on one cut prompt), then every timed run
    summary = (out / "summary.md").read_text()
    assert "## Shared prefills" in summary and "chunks of 128" in summary and "one forward" in summary


def test_shared_prefill_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="generation.share_prefill"):
        load_config(write_yaml(tmp_path, dict(SHARED, generation={"share_prefill": True}, arrivals={"requests": 2})))
    with pytest.raises(ConfigError, match="generation.one_forward_items"):
        load_config(write_yaml(tmp_path, dict(SHARED, generation={"one_forward_items": 1})))
    exp = load_config(write_yaml(tmp_path, dict(SHARED, generation={"share_prefill": True})))
    with pytest.raises(ValueError, match="share_prefill"):
        run_experiment(exp, tmp_path / "ray", model=make_tiny_model(), tokenizer=CharTokenizer(), quiet=True, ray=True)
    assert not (tmp_path / "ray").exists()


def _count_starts(monkeypatch) -> list[int]:
    """Record the rows of every call that starts from a kept prefill."""
    from accel.steps import KeptPrefill

    started: list[int] = []
    start = KeptPrefill.start

    def counted(self, cache, compress, window, queries, rows=None):
        started.append(len(rows) if rows is not None else len(self.rows))
        return start(self, cache, compress, window, queries, rows)

    monkeypatch.setattr(KeptPrefill, "start", counted)
    return started


def test_shared_prefill_in_batches_of_one_document(tmp_path, monkeypatch):
    spec = dict(SHARED, tasks=[{"kind": "needle", "lengths": [500], "depths": [0.5]}], batch_sizes=[1, 3],
                generation={"max_new_tokens": 8})
    model = make_tiny_model(max_position_embeddings=2048)
    alone = _rows(run_experiment(load_config(write_yaml(tmp_path, spec)), tmp_path / "alone", model=model,
                                 tokenizer=CharTokenizer(), quiet=True))
    spec["generation"] = {"max_new_tokens": 8, "share_prefill": True}
    started = _count_starts(monkeypatch)
    rows = _rows(run_experiment(load_config(write_yaml(tmp_path, spec)), tmp_path / "shared", model=model,
                                tokenizer=CharTokenizer(), quiet=True))
    prefill, again = [r for r in rows if r.get("mode") == "prefill"]
    assert prefill["error"] is None and prefill["batch_size"] == 1 and prefill["prefill_s"] > 0
    assert again["reused"] and again["batch_size"] == 3 and again["prefill_s"] == prefill["prefill_s"]
    shared = {r["config"]: r for r in rows if r.get("mode") == "batch" and r["batch_size"] == 3}
    assert set(shared) == {"full", "snapkv", "snapkv_pl"}
    for r in [r for r in alone if r["batch_size"] == 3]:
        mine = shared[r["config"]]
        assert [p["text"] for p in mine["rows"]] == [p["text"] for p in r["rows"]]
        assert mine["kv_bytes_kept"] == r["kv_bytes_kept"] and mine["exact_rows"] == r["exact_rows"]
    # after the warm-ups (batches of 2 on a cut prompt), every configuration's batch of 1, then
    # of 3, started from the one-row prefill
    assert started[3:] == [1, 1, 1, 3, 3, 3]
