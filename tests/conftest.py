"""Shared pytest fixtures.

- ``tiny_model``: a fresh random tiny Llama (see ``helpers.make_tiny_model``); cheap, per test.
- ``default_model``: ``(model, tokenizer)`` of the real default model, SmolLM2-135M-Instruct,
  loaded once per session. Tests using it carry ``@pytest.mark.real_model``.
- ``heads_dir``: a folder holding random sequential Medusa heads for the tiny models
  (``helpers.random_heads(seed=3, sequential=True)``), written once per session.

Tests marked ``models`` (the packaged Qwen and Gemma3 models, gigabytes and minutes to load) run only
when selected by name: ``pytest -m models`` (``make test-models``); otherwise they are skipped.

Calibration is off in tests (``ACCEL_CALIBRATION=off``) unless the environment sets it.

MKL runs in its conditional-reproducibility mode (``MKL_CBWR=AVX2``) unless the environment
sets it. bf16 drafting is exact only where this machine's float32 products pass
:func:`accel.kernels.ordered.probe`, and that property belongs to the kernels: MKL's default AVX2 path
on an AMD EPYC (Zen 3, 2 threads) gives the second matrix of a batch other numbers than the
first, while the Intel Xeons' does not. With the mode set, the bf16 tests check accel's own
arithmetic on any x86 machine; the approximate label where the probe fails is tested by
monkeypatching it (tests/test_invariance.py). It must be set before the first MKL call.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("MKL_CBWR", "AVX2")

import pytest  # noqa: E402

from helpers import make_tiny_model, random_heads  # noqa: E402

# Loading a model with prepack="auto" would otherwise measure this machine (~20 s for the
# default model) and write the table into the user's cache: tests get the static table
# unless ACCEL_CALIBRATION is set, and test_calibrate.py measures in a temporary cache.
os.environ.setdefault("ACCEL_CALIBRATION", "off")


def pytest_collection_modifyitems(config, items):
    if re.search(r"(?<!not )\bmodels\b", config.getoption("markexpr") or ""):
        return  # selected by name
    skip = pytest.mark.skip(reason="packaged-model test: run with `pytest -m models` (make test-models)")
    for item in items:
        if item.get_closest_marker("models") is not None:
            item.add_marker(skip)


@pytest.fixture
def tiny_model():
    """A random tiny ``LlamaForCausalLM`` (seed 0, 2 KV heads), eval mode, float32."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def default_model():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct via ``accel.models.load_default()``."""
    from accel.models import load_default

    return load_default()


@pytest.fixture(scope="session")
def heads_dir(tmp_path_factory):
    """Path (str) of a folder holding random sequential Medusa heads for the tiny models."""
    folder = tmp_path_factory.mktemp("heads")
    random_heads(seed=3, sequential=True).save_pretrained(folder)
    return str(folder)
