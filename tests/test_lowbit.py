"""Int8 / int4 weight-only verifiers (accel.kernels.lowbit): the quantized linear layers
against their dequantized weights, which layers are quantized, bad input, loading, greedy
drafting exact on the quantized model, calibration keyed by the quantization, and the bench's
quantize / precisions fields."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import accel
from accel.kernels import invariance, lowbit
from helpers import TINY_VOCAB, make_tiny_model, make_tiny_tokenizer
from snapkv import SnapKV
from speculative import Medusa, PromptLookup
from helpers import Scripted, random_heads, left_padded, repetitive_prompt

HAS_INT8 = hasattr(torch.ops.aten, "_weight_int8pack_mm")
HAS_INT4 = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
    hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")
needs_int8 = pytest.mark.skipif(not HAS_INT8, reason="this torch build has no torch.ops.aten._weight_int8pack_mm")
needs_int4 = pytest.mark.skipif(not HAS_INT4, reason="this torch build has no torch.ops.aten._weight_int4pack_mm_for_cpu")
SCHEMES = [pytest.param("int8", marks=needs_int8), pytest.param("int4", marks=needs_int4)]


def _linear(out_features: int, in_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.2)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer


def _quantized(scheme: str, seed: int = 0, **overrides) -> nn.Module:
    return lowbit.quantize_model(make_tiny_model(seed=seed, **overrides), scheme)


# ---------------------------------------------------------------------------- the layers


@needs_int8
def test_int8_layer_multiplies_by_its_dequantized_weight():
    linear = _linear(40, 96)
    layer = lowbit.Int8WeightLinear(linear)
    codes, scales = lowbit.quantize_int8(linear.weight)
    deq = lowbit.dequantize_int8(codes, scales)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127  # each channel's max uses the range
    # symmetric per channel: within half a step of the original weight
    assert ((deq - linear.weight).abs() <= scales.float()[:, None] * 0.5 + 1e-6).all()
    x = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == (2, 5, 40) and out.dtype == torch.bfloat16
    ref = x.float() @ deq.T + linear.bias.to(torch.bfloat16).float()
    assert torch.allclose(out.float(), ref, atol=0.03, rtol=0.01)  # bf16 rounding of the output only
    assert torch.allclose(layer.dequantized(), deq)


@needs_int4
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_layer_multiplies_by_its_dequantized_weight(group):
    linear = _linear(48, 256, seed=group)
    layer = lowbit.Int4WeightLinear(linear, group)
    codes, scales, zeros = lowbit.quantize_int4(linear.weight, group)
    deq = lowbit.dequantize_int4(codes, scales, zeros)
    assert codes.min() == 0 and codes.max() == 15 and scales.shape == (48, 256 // group)
    # asymmetric groups: each weight within about half a step of the original
    step = scales.float().repeat_interleave(group, dim=1)
    assert ((deq - linear.weight).abs() <= step * 0.51 + 1e-3).all()
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
    ref = x.float() @ deq.T + linear.bias.to(torch.bfloat16).float()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=0.03, rtol=0.01)
    # a wrong group size or unpacked codes read as packed ones would be far off
    wrong = lowbit.dequantize_int4(codes.flip(1), scales, zeros)
    assert not torch.allclose(out.float(), x.float() @ wrong.T + linear.bias.float(), atol=0.3)


@needs_int4
def test_int4_rows_are_the_rows_of_a_bigger_call_and_of_their_own():
    layer = lowbit.Int4WeightLinear(_linear(64, 128, bias=False), 64)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.inference_mode():
        whole = layer(x)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.allclose(whole.float(), alone.float(), atol=0.03, rtol=0.01)  # (bit equality is the probe's)


def test_group_size_divides_every_layer_where_one_can():
    assert lowbit.choose_group_size([576, 1536]) == 64  # the default model: 576 rules out 128
    assert lowbit.choose_group_size([4096, 11008]) == 256
    assert lowbit.choose_group_size([64, 128]) == 64
    assert lowbit.choose_group_size([96, 160, 100]) == 32  # none divides 100: the one dividing the most


# ---------------------------------------------------------------------------- models


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_model_swaps_the_decoder_layers_and_keeps_the_output_layer(scheme):
    model = make_tiny_model(seed=1)
    ids = torch.randint(2, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = model(ids).logits
    lowbit.quantize_model(model, scheme)
    info = lowbit.quantization_of(model)
    assert info.scheme == scheme and info.quantized == 2 * 7 and info.kept == ("lm_head",) and not info.lm_head
    assert info.group_size == (64 if scheme == "int4" else None)
    assert info.weights == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)  # q, o; k, v (2 KV heads); mlp
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())  # embeddings, norms, output layer
    assert accel.adapter.geometry(model).dtype == torch.bfloat16
    with torch.inference_mode():
        out = model(ids).logits
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.25 * ref.abs().max()  # close to the float model, not equal
    assert not torch.equal(out.float(), ref)
    with pytest.raises(ValueError, match="quantized already"):
        lowbit.quantize_model(model, scheme)


@needs_int4
def test_layers_the_int4_kernel_cannot_take_stay_bf16_and_are_reported(capsys):
    model = make_tiny_model(intermediate_size=96)  # down_proj's 96 inputs are no multiple of 64
    lowbit.quantize_model(model, "int4:group_size=64")
    info = lowbit.quantization_of(model)
    assert set(info.kept) == {"lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}
    assert info.quantized == 2 * 6 and info.group_size == 64
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    err = capsys.readouterr().err
    assert "2 linear layer(s) stay bfloat16" in err and "model.layers.0.mlp.down_proj (in_features 96" in err
    with torch.inference_mode():
        assert model(torch.tensor([[3, 4, 5]])).logits.isfinite().all()
    auto = lowbit.quantize_model(make_tiny_model(intermediate_size=96), "int4")  # auto: 32 divides all
    assert lowbit.quantization_of(auto).group_size == 32 and lowbit.quantization_of(auto).kept == ("lm_head",)


@needs_int8
def test_output_layer_quantized_on_request():
    model = lowbit.quantize_model(make_tiny_model(), "int8:lm_head=true")
    info = lowbit.quantization_of(model)
    assert info.lm_head and info.kept == () and isinstance(model.get_output_embeddings(), lowbit.Int8WeightLinear)
    assert info.name == "int8:lm_head=true"
    # the int4 kernel needs output features in multiples of 16: the tiny vocabulary (97) stays
    if HAS_INT4:
        four = lowbit.quantize_model(make_tiny_model(), "int4:lm_head=true")
        assert not lowbit.quantization_of(four).lm_head and lowbit.quantization_of(four).kept == ("lm_head",)


# ---------------------------------------------------------------------------- bad input


def test_quantization_names():
    assert lowbit.as_quantization(None) is None and lowbit.as_quantization("none") is None
    q = lowbit.as_quantization("INT4:group_size=64, lm_head=true")
    assert (q.scheme, q.group_size, q.lm_head) == ("int4", 64, True) and str(q) == "int4:group_size=64,lm_head=true"
    assert str(lowbit.as_quantization({"scheme": "int8"})) == "int8"
    assert lowbit.as_quantization(q) is q
    for bad, why in [("int3", "unknown quantization 'int3'; choose one of int8, int4"),
                     ("int4:group_size=48", "group_size"), ("int8:group_size=64", "int4 only"),
                     ("int4:colour=red", "colour"), ("int4:lm_head", "key=value"), (4, "a name or a mapping")]:
        with pytest.raises(ValueError, match=why):
            lowbit.as_quantization(bad)


def test_cli_names_the_choices(capsys):
    from accel.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--quantize", "int3", "hello"])
    assert exit_.value.code == 2 and "choose one of int8, int4" in capsys.readouterr().err


def test_a_kernel_the_build_lacks_is_named_before_anything_loads(monkeypatch):
    monkeypatch.setitem(lowbit._OPS, "int4", ("_no_such_int4_kernel",))
    monkeypatch.setattr(lowbit, "_problems", {})

    def load(*args, **kwargs):
        raise AssertionError("must not load")

    with pytest.raises(ValueError, match=r"needs torch.ops.aten._no_such_int4_kernel, which this torch build .* "
                                         r"lacks; try quantize='int8' or no quantization"):
        lowbit.load_quantized(load, "default", quantize="int4", dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="_no_such_int4_kernel"):
        lowbit.quantize_model(make_tiny_model(), "int4")


def test_cuda_without_torchao_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "torchao", None)  # as if torchao were not installed
    monkeypatch.setitem(__import__("sys").modules, "torchao.quantization", None)
    with pytest.raises(ValueError, match="on CUDA needs torchao .* not importable"):
        lowbit._torchao_quantize(make_tiny_model(), lowbit.as_quantization("int4"), torch.bfloat16)


def test_compute_dtype():
    assert lowbit.compute_dtype(torch.float32, "cpu") == torch.bfloat16
    assert lowbit.compute_dtype(torch.float16, "cpu") == torch.bfloat16
    assert lowbit.compute_dtype(torch.float16, "cuda:0") == torch.float16
    assert lowbit.compute_dtype(torch.float32, "cuda") == torch.bfloat16


# ---------------------------------------------------------------------------- loading


@needs_int8
def test_load_model_and_load_shared_quantize(tmp_path):
    from accel.models import load_model, load_shared

    make_tiny_model(seed=6).save_pretrained(tmp_path / "tiny")
    model, tok = load_model(tmp_path / "tiny", quantize="int8")
    assert tok is None and lowbit.quantization_of(model).scheme == "int8"
    assert next(model.parameters()).dtype == torch.bfloat16
    plain, _ = load_model(tmp_path / "tiny", quantize="none")
    assert lowbit.quantization_of(plain) is None and next(plain.parameters()).dtype == torch.float32
    # quantized from the float32 checkpoint: the same codes as quantizing the float model
    ref = lowbit.quantize_model(make_tiny_model(seed=6), "int8")
    assert torch.equal(model.model.layers[1].mlp.up_proj.qweight, ref.model.layers[1].mlp.up_proj.qweight)
    a, _ = load_shared(str(tmp_path / "tiny"), quantize="int8")
    assert load_shared(str(tmp_path / "tiny"), quantize="int8")[0] is a
    assert load_shared(str(tmp_path / "tiny"))[0] is not a
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        load_model(tmp_path / "nowhere", quantize="int3")  # the name is checked before the path


def test_cli_commands_pass_the_quantization(monkeypatch, capsys):
    import accel.models
    from accel.cli import main

    seen = []

    def fake_load(name, dtype=torch.float32, quantize=None, **kw):
        seen.append(quantize)
        return make_tiny_model(seed=2), make_tiny_tokenizer()

    monkeypatch.setattr(accel.models, "load_model", fake_load)
    assert main(["generate", "--quantize", "INT4:lm_head=true", "--max-new-tokens", "3", "hello world"]) == 0
    assert main(["generate", "--max-new-tokens", "3", "hello world"]) == 0
    assert main(["generate", "--quantize", "none", "--max-new-tokens", "3", "hello world"]) == 0
    assert seen == ["int4:lm_head=true", None, "none"]
    capsys.readouterr()


def test_bench_quantize_flag_is_an_override(monkeypatch, tmp_path):
    import argparse

    import accel.bench as bench

    got = {}

    def fake_run(experiment, out=None, command=None, **kwargs):
        got["experiment"], got["command"] = experiment, command
        (tmp_path / "results.jsonl").write_text("")
        return tmp_path

    monkeypatch.setattr(bench, "run_experiment", fake_run)
    config = tmp_path / "e.yaml"
    config.write_text("tasks: [{kind: chat, prompts: 1}]\n")
    args = argparse.Namespace(config=str(config), out=None, set=[], quantize="int4:lm_head=true")
    assert bench.run_cli(args) == 0
    assert str(got["experiment"].quantize) == "int4:lm_head=true" and got["experiment"].precision == "int4:lm_head=true"
    assert got["command"].endswith("--quantize int4:lm_head=true")


# ---------------------------------------------------------------------------- exactness


def _equal_rows(model, ids, strategies, mask=None, new=20):
    kw = dict(attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    ref = accel.generate(model, ids, strategies=[], **kw)
    out = accel.generate(model, ids, strategies=strategies, **kw)
    return out, all(torch.equal(g, r) for g, r in zip(out.sequences, ref.sequences))


_MODELS: dict[str, nn.Module] = {}


def _shared(scheme: str) -> nn.Module:
    """One quantized tiny model per scheme for the module: its invariance probe runs once."""
    if scheme not in _MODELS:
        _MODELS[scheme] = _quantized(scheme, seed=11)
    return _MODELS[scheme]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_drafting_equals_plain_decoding_of_the_quantized_model(scheme, tmp_path):
    model = _shared(scheme)
    rows = invariance.verify_rows(model)
    assert rows in invariance.CANDIDATES and invariance.is_exact(model)
    prompts = [repetitive_prompt(s, n)[0] for s, n in ((1, 40), (2, 23), (3, 51))]
    ids, mask = left_padded(prompts)
    random_heads(seed=3, std=1.0).save_pretrained(tmp_path)
    for strategies in ([PromptLookup()], [Medusa(heads=str(tmp_path), max_nodes=8)]):
        out, same = _equal_rows(model, ids, strategies, mask)  # a batch of three
        assert out.stats.exact_verify and out.stats.drafted_tokens > 0 and same, strategies
    for p in prompts[:1]:  # garbage drafts
        out, same = _equal_rows(model, p[None], [Scripted(mode="random", size=7)])
        assert out.stats.drafted_tokens > 0 and out.stats.exact_verify and same


@pytest.mark.parametrize("scheme", SCHEMES)
def test_snapkv_reads_the_queries_of_quantized_projections(scheme):
    model = _shared(scheme)
    ids = repetitive_prompt(4, 60)
    kept = [SnapKV(budget=24, window=4, kernel=3)]
    ref = accel.generate(model, ids, strategies=kept, max_new_tokens=16, eos_token_id=[])
    out = accel.generate(model, ids, strategies=kept + [PromptLookup()], max_new_tokens=16, eos_token_id=[])
    assert ref.stats.kv_bytes_kept < ref.stats.kv_bytes_full
    assert out.stats.exact_verify and out.stats.drafted_tokens > 0 and torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_plain_accel_equals_model_generate_on_the_quantized_model(scheme):
    model = _shared(scheme)
    ids = repetitive_prompt(5, 30)
    ours = accel.generate(model, ids, strategies=[], max_new_tokens=16, eos_token_id=[]).sequences
    theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                            eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, theirs)


@needs_int8
@pytest.mark.filterwarnings("default")
def test_a_quantized_path_that_fails_its_probe_is_labelled_approximate():
    model = _quantized("int8", seed=13)

    def by_rows(module, args, out):  # a kernel whose result depends on the row count
        return out + 0.0625 * args[0].reshape(-1, args[0].shape[-1]).shape[0]

    model.model.layers[0].mlp.down_proj.register_forward_hook(by_rows)
    with pytest.warns(RuntimeWarning, match=r"int8 \(torch.bfloat16 activations\) verification .* is approximate"):
        assert invariance.verify_rows(model) == 1
    assert not invariance.is_exact(model)
    out = accel.generate(model, repetitive_prompt(2, 30), strategies=[PromptLookup()], max_new_tokens=6, eos_token_id=[])
    assert not out.stats.exact_verify and "approximate" in out.stats.summary()


@needs_int8
def test_a_model_quantized_in_place_is_probed_again(monkeypatch):
    model = make_tiny_model(seed=14).to(torch.bfloat16)
    calls = []
    monkeypatch.setattr(invariance, "probe", lambda m, rows, align=1: calls.append(rows) or True)
    invariance.verify_rows(model)
    first = len(calls)
    invariance.verify_rows(model)
    assert len(calls) == first  # remembered
    lowbit.quantize_model(model, "int8")
    invariance.verify_rows(model)
    assert len(calls) > first  # other kernels now: measured again


# ---------------------------------------------------------------------------- calibration


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_quantization_gets_its_own_cost_table(scheme, tmp_path, monkeypatch):
    from accel.calibration import calibrate, timing
    from helpers import fake_measure

    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ACCEL_CALIBRATION", raising=False)
    bf16 = make_tiny_model().to(torch.bfloat16)
    quant = lowbit.quantize_model(make_tiny_model(), scheme)
    key, plain_key = calibrate.calibration_key(quant), calibrate.calibration_key(bf16)
    assert plain_key["quantize"] is None and key["quantize"]["scheme"] == scheme
    assert key["dtype"] == plain_key["dtype"] == "bfloat16"  # the same activations: only the quantization tells
    assert calibrate.calibration_path(key) != calibrate.calibration_path(plain_key)
    if scheme == "int4":
        other = lowbit.quantize_model(make_tiny_model(), "int4:group_size=32")
        assert calibrate.calibration_key(other) != key
    calls: list = []
    monkeypatch.setattr(timing, "measure", fake_measure(calls))
    table = calibrate.cost_table(quant)
    assert table.measured and len(calls) == 1 and table.key["quantize"]["scheme"] == scheme
    calibrate.cost_table(bf16)
    assert len(calls) == 2  # not the quantized model's table
    calibrate.cost_table(lowbit.quantize_model(make_tiny_model(seed=9), scheme))
    assert len(calls) == 2  # the same quantization of the same shapes: read back
    files = sorted(p.name for p in (tmp_path / "calibration").iterdir())
    assert len(files) == 2 and not [f for f in files if f.startswith(".")]


@needs_int8
def test_an_interrupted_calibration_leaves_nothing_half_written(tmp_path, monkeypatch):
    from accel.calibration import calibrate, timing

    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    monkeypatch.delenv("ACCEL_CALIBRATION", raising=False)

    def interrupted(model, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(timing, "measure", interrupted)
    with pytest.raises(KeyboardInterrupt):
        calibrate.cost_table(_quantized("int8"))
    folder = tmp_path / "calibration"
    assert not folder.exists() or not list(folder.iterdir())


# ---------------------------------------------------------------------------- bench


def test_bench_schema_takes_quantize_and_precisions(tmp_path):
    from accel.bench import ConfigError, load_config
    from helpers import CONFIGS, write_yaml

    base = {"tasks": [{"kind": "chat", "prompts": 1}], "runs": {"plain": []}}
    exp = load_config(write_yaml(tmp_path, dict(base, quantize="int4")))
    assert str(exp.quantize) == "int4" and exp.precision == "int4" and exp.configuration_names() == ["hf_generate", "plain"]
    exp = load_config(write_yaml(tmp_path, dict(base, quantize={"scheme": "int4", "lm_head": True})))
    assert exp.precision == "int4:lm_head=true"
    assert json.loads(json.dumps(exp.model_dump(mode="json")))["quantize"]["scheme"] == "int4"
    exp = load_config(write_yaml(tmp_path, dict(base, precisions=["fp32", "bf16", "int8"], reference="plain@float32")))
    assert exp.precisions == ["float32", "bfloat16", "int8"]
    assert exp.configuration_names()[:3] == ["hf_generate@float32", "plain@float32", "hf_generate@bfloat16"]
    bad = dict(base, quantize="int3", precisions=["int4", "int4", "int2"])
    with pytest.raises(ConfigError) as err:
        load_config(write_yaml(tmp_path, bad))
    text = str(err.value)
    assert "quantize: unknown quantization 'int3'" in text and "precisions[2]: unknown precision 'int2'" in text
    with pytest.raises(ConfigError, match="precisions: int4 is listed twice"):
        load_config(write_yaml(tmp_path, dict(base, precisions=["int4", "int4"], reference="plain@int4")))
    with pytest.raises(ConfigError, match="quantize: with precisions"):
        load_config(write_yaml(tmp_path, dict(base, quantize="int8", precisions=["int4"], reference="plain@int4")))
    with pytest.raises(ConfigError, match="reference: 'hf_generate' is neither"):
        load_config(write_yaml(tmp_path, dict(base, precisions=["int4"])))
    shipped = load_config(CONFIGS / "precision.yaml")
    assert shipped.precisions == ["float32", "bfloat16", "int8", "int4"] and shipped.reference == "accel_plain@float32"
    assert {"prompt_lookup@int4", "medusa@int8", "accel_plain@bfloat16"} <= set(shipped.configuration_names())


@pytest.mark.skipif(not (HAS_INT8 and HAS_INT4), reason="this torch build lacks an int8 or int4 weight kernel")
def test_bench_runs_every_configuration_on_every_precision(tmp_path):
    from accel.bench import load_config, run_experiment
    from helpers import CharTokenizer
    from helpers import write_yaml

    data = {"tasks": [{"kind": "chat", "prompts": 2}], "baselines": ["hf_generate"],
            "runs": {"plain": [], "lookup": ["prompt_lookup"]}, "precisions": ["float32", "int8", "int4"],
            "reference": "plain@float32", "generation": {"max_new_tokens": 6}, "warmup_tokens": 0, "threads": 1}
    out = run_experiment(load_config(write_yaml(tmp_path, data)), tmp_path / "out", model=make_tiny_model(seed=15),
                         tokenizer=CharTokenizer(), quiet=True)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert not [r["error"] for r in rows if r["error"]]
    assert {(r["config"], r["precision"]) for r in rows} == {
        (f"{c}@{p}", p) for c in ("hf_generate", "plain", "lookup") for p in ("float32", "int8", "int4")}
    text = {(r["config"], r["item"]): r["text"] for r in rows}
    for p in ("int8", "int4"):  # on each precision, drafting and transformers reproduce its plain decoding
        for item in {r["item"] for r in rows}:
            assert text[(f"lookup@{p}", item)] == text[(f"plain@{p}", item)] == text[(f"hf_generate@{p}", item)]
    assert all(r["exact"] for r in rows if r["config"].endswith("@float32"))
    summary = (out / "summary.md").read_text()
    assert "precisions float32, int8, int4" in summary and "`lookup@int4`" in summary
    assert json.loads((out / "meta.json").read_text())["machine"]["precisions"] == ["float32", "int8", "int4"]


@pytest.mark.real_model
@pytest.mark.skipif(not HAS_INT4, reason="this torch build has no torch.ops.aten._weight_int4pack_mm_for_cpu")
def test_default_model_in_int4_keeps_only_its_output_layer_in_bf16():
    from accel.models import chat_ids, load_default

    model, tok = load_default(quantize="int4")
    info = lowbit.quantization_of(model)
    assert (info.scheme, info.group_size, info.kept, info.quantized) == ("int4", 64, ("lm_head",), 30 * 7)
    ids = chat_ids(tok, "What is the capital of France?")
    # (model.generate: accel.generate would first probe this model's kernels, a minute or more here)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
