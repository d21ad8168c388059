# `make serve`, `make test` (everything, as CI runs it) and `make test-fast` (an inner loop without
# the tests marked slow: real servers in subprocesses). Each creates .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fp4serve-installed

.PHONY: serve test test-fast install clean

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@# Install the local CPU torch first so no dependency ever pulls a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -e '.[test]'
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
