"""Dtypes as strings wherever a dtype is taken: load_model / load_default, the CLI, bench YAML,
Medusa's head dtype."""

from __future__ import annotations

import pytest
import torch

from accel.dtypes import as_dtype, dtype_name
from helpers import make_tiny_model


@pytest.mark.parametrize("given, expected", [("float32", torch.float32), ("fp32", torch.float32),
                                             ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                             ("BF16", torch.bfloat16), ("torch.bfloat16", torch.bfloat16),
                                             ("float16", torch.float16), ("fp16", torch.float16),
                                             ("half", torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_names_and_dtypes_resolve(given, expected):
    assert as_dtype(given) == expected


@pytest.mark.parametrize("wrong", ["int3", "bfloat", "", torch.int8, 16])
def test_a_wrong_name_lists_the_choices(wrong):
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        dtype_name(wrong)


def test_load_model_takes_a_dtype_name(tmp_path):
    from accel.models import load_model, load_shared

    make_tiny_model().save_pretrained(tmp_path)
    for name in ("bfloat16", "bf16"):
        model, _ = load_model(tmp_path, dtype=name, prepack=False)
        assert next(model.parameters()).dtype == torch.bfloat16
    a, _ = load_shared(tmp_path, "bf16")
    b, _ = load_shared(tmp_path, torch.bfloat16)
    assert a is b  # one shared copy whatever the spelling
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        load_model(tmp_path, dtype="int3")


@pytest.mark.real_model
def test_load_default_takes_a_dtype_name():
    import accel

    model, _ = accel.load_model("default", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_cli_dtype_flag(capsys):
    from accel.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "hi", "--dtype", "bf16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--dtype", "int3"])
    assert "choose one of float32, bfloat16, float16" in capsys.readouterr().err


CONFIG = "dtype: {dtype}\ntasks: [{{kind: chat, prompts: 1}}]\nruns:\n  plain: []\n"


def test_bench_yaml_dtype(tmp_path):
    from accel.bench import ConfigError, load_config

    path = tmp_path / "exp.yaml"
    path.write_text(CONFIG.format(dtype="bf16"))
    assert load_config(path).dtype == "bfloat16"
    path.write_text(CONFIG.format(dtype="int3"))
    with pytest.raises(ConfigError, match="dtype"):
        load_config(path)


def test_medusa_head_dtype_alias():
    from speculative import Medusa

    assert Medusa(head_dtype="bf16").head_dtype == "bfloat16"
    assert Medusa(head_dtype="model").head_dtype == "model"
    with pytest.raises(ValueError, match="head_dtype"):
        Medusa(head_dtype="int3")
