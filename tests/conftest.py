"""Shared pytest fixtures.

- ``tiny_model``: a fresh random tiny Llama (see ``helpers.make_tiny_model``); cheap, per test.
- ``default_model``: ``(model, tokenizer)`` of the real default model, SmolLM2-135M-Instruct,
  loaded once per session. Tests using it carry ``@pytest.mark.real_model``.

Tests marked ``models`` (the packaged Qwen and Gemma3 models, gigabytes and minutes to load) run only
when selected by name: ``pytest -m models`` (``make test-models``); otherwise they are skipped.

Calibration is off in tests (``ACCEL_CALIBRATION=off``) unless the environment sets it.
"""

from __future__ import annotations

import os
import re

import pytest

from helpers import make_tiny_model

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
